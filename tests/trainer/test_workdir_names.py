"""A workdir error names the workdir the way the user gave it: main's `--workdir DIR`, or
`WORKDIR=DIR` under launch/local.sh (which sets GSPO_WORKDIR_FLAG); the script's default
workdir follows the config's name."""

import subprocess
from pathlib import Path

import pytest

from gspo_jax.trainer.io.workdir import WorkdirError, prepare

ROOT = Path(__file__).resolve().parents[2]


def test_the_error_names_the_flag_or_the_scripts_variable(tmp_path, monkeypatch):
    afile = tmp_path / "run"
    afile.write_text("not a directory")
    with pytest.raises(WorkdirError, match=rf"--workdir {afile} is a file"):
        prepare(str(afile), str(afile / "checkpoints"))
    monkeypatch.setenv("GSPO_WORKDIR_FLAG", "WORKDIR=")
    with pytest.raises(WorkdirError, match=rf"WORKDIR={afile} is a file"):
        prepare(str(afile), str(afile / "checkpoints"))


@pytest.mark.parametrize(
    ("config", "workdir"),
    [
        ("configs/default.py", "workdirs/default"),
        ("configs/grpo_paper.py", "workdirs/grpo_paper"),
        ("configs/moe_tiny.py:algo=grpo", "workdirs/moe_tiny"),
    ],
)
def test_local_sh_gives_each_config_its_own_workdir(config, workdir):
    """The lines of launch/local.sh that choose the workdir, run alone."""
    script = (ROOT / "launch" / "local.sh").read_text()
    lines = [
        x for x in script.splitlines() if x.startswith(("CONFIG=", "config_file=", "WORKDIR="))
    ]
    out = subprocess.run(
        ["bash", "-c", "\n".join(lines) + '\necho "$WORKDIR"'],
        env={"CONFIG": config, "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == workdir
