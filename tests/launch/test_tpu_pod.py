"""launch/tpu_pod.sh: the exact gcloud commands it prints (--dry-run) for a v5e-8 and a
v5p-64, its quoting through both shells, its errors, and (with a fake gcloud that plays one
TPU host in a temporary directory) that it runs what it prints and that setup, run, status
and stop do what they say on a host.

Each test runs the launcher from a throwaway git repository holding a copy of it and of the
project's requirements.txt, so the results do not depend on this checkout's uncommitted
changes. No jax, no network.
"""

from __future__ import annotations

import ctypes
import importlib.util
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

import pytest

PROJECT = Path(__file__).resolve().parents[2]
GIT_ENV = {"GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1"}


def _jax_pin() -> str:
    (line,) = [x for x in (PROJECT / "requirements.txt").read_text().splitlines() if "jax==" in x]
    return line.split("==")[1].strip()


JAX = _jax_pin()


def _default_libtpu_init_args() -> str:
    spec = importlib.util.spec_from_file_location("tpu_pod", PROJECT / "launch" / "tpu_pod.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.DEFAULT_LIBTPU_INIT_ARGS


DEFAULT_LIBTPU_INIT_ARGS = _default_libtpu_init_args()


def git(repo: Path, *args: str) -> str:
    env = {**os.environ, **GIT_ENV}
    out = subprocess.run(
        ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@example.com", *args],
        capture_output=True,
        text=True,
        check=True,
        env=env,
    )
    return out.stdout


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A git repo with the launcher, requirements.txt and a stand-in package, committed."""
    root = tmp_path / "checkout"
    (root / "launch").mkdir(parents=True)
    for name in ("tpu_pod.sh", "tpu_pod.py"):
        shutil.copy(PROJECT / "launch" / name, root / "launch" / name)
    shutil.copy(PROJECT / "requirements.txt", root / "requirements.txt")
    (root / "gspo_jax").mkdir()
    (root / "gspo_jax" / "__init__.py").write_text('"""stand-in"""\n')
    (root / ".gitignore").write_text(".venv/\n")
    git(root, "init", "-q")
    git(root, "add", "-A")
    git(root, "commit", "-qm", "init")
    return root


def launch(repo: Path, *args: str, env: dict | None = None, dry: bool = True):
    """Run `bash launch/tpu_pod.sh ARGS` with nothing from the caller's environment but PATH."""
    tmp = repo.parent / "tmp"
    tmp.mkdir(exist_ok=True)
    full_env = {
        "PATH": os.environ["PATH"],
        "HOME": str(repo.parent),
        "TMPDIR": str(tmp),
        "LAUNCH_PYTHON": sys.executable,
        **GIT_ENV,
        **(env or {}),
    }
    argv = ["bash", str(repo / "launch" / "tpu_pod.sh"), *(["--dry-run"] if dry else []), *args]
    return subprocess.run(
        argv, check=False, capture_output=True, text=True, env=full_env, timeout=60
    )


def commit_of(repo: Path) -> str:
    return git(repo, "rev-parse", "HEAD").strip()


def tarball_of(repo: Path) -> str:
    return str(repo.parent / "tmp" / f"gspo_jax-{commit_of(repo)[:12]}.tar.gz")


# The remote scripts, spelled out: what a host's shell receives after `--command=`.
CHECK = (
    'R=gspo_jax; PY=python3; command -v "$PY" >/dev/null 2>&1 || { echo "gspo_jax setup: $PY '
    "not found on $(hostname). Re-run setup with --install-python (apt-installs python3.11 "
    'and python3.11-venv on every host) or --python=PATH." >&2; exit 1; }; "$PY" -c "import '
    'sys; sys.exit(sys.version_info < (3, 11))" || { echo "gspo_jax setup: the pinned jax '
    'needs Python >= 3.11, but $PY on $(hostname) is $("$PY" --version 2>&1). Re-run setup '
    "with --install-python (apt-installs python3.11 and python3.11-venv on every host) or "
    '--python=PATH to a Python >= 3.11." >&2; exit 1; }; "$PY" -c "import ensurepip, venv" '
    '>/dev/null 2>&1 || { echo "gspo_jax setup: $PY on $(hostname) cannot make a venv '
    '(Debian/Ubuntu split it out): sudo apt-get install -y $(basename "$PY")-venv, or re-run '
    'setup with --install-python." >&2; exit 1; }; if [ -f "$R/run.pid" ] && kill -0 "$(cat '
    '"$R/run.pid")" 2>/dev/null; then echo "gspo_jax setup: a run is going on $(hostname) '
    '(pid $(cat "$R/run.pid")): stop it first (tpu_pod.sh stop)." >&2; exit 1; fi; mkdir -p '
    '"$R"'
)
INSTALL = (
    "R=gspo_jax; PY=python3; COMMIT={commit}; JAX={jax}; "
    'set -e; cd "$R"; rm -rf code.new; mkdir code.new; tar -xzf code.tar.gz -C code.new; '
    'echo "$COMMIT" > code.new/COMMIT; rm -rf code; mv code.new code; rm -f code.tar.gz; '
    'if ! venv/bin/python -c "import sys; sys.exit(sys.version_info < (3, 11))" 2>/dev/null; '
    'then rm -rf venv; "$PY" -m venv venv; fi; echo "gspo_jax: $(hostname): installing '
    'jax[tpu]==$JAX and code/requirements.txt into $R/venv (minutes the first time)"; '
    "venv/bin/python -m pip install -q --upgrade pip; "
    'venv/bin/python -m pip install -q "jax[tpu]==$JAX" -r code/requirements.txt; '
    "venv/bin/python -m pip install -q --no-deps -e code; "
    'echo "gspo_jax: $(hostname) has commit $COMMIT in $R/code, jax $(venv/bin/python -c '
    '"import jax; print(jax.__version__)")"'
)


def expected_setup(repo: Path, tpu: str, zone: str, project: str) -> list[str]:
    where = f"--zone={zone} --project={project}"
    commit = commit_of(repo)
    ssh = f"gcloud compute tpus tpu-vm ssh {tpu} {where} --worker=all"
    return [
        f"{ssh} {shlex.quote('--command=' + CHECK)}",
        f"git -C {repo} archive --format=tar.gz --output={tarball_of(repo)} {commit}",
        (
            f"gcloud compute tpus tpu-vm scp {tarball_of(repo)} {tpu}:gspo_jax/code.tar.gz "
            f"{where} --worker=all"
        ),
        f"{ssh} {shlex.quote('--command=' + INSTALL.format(commit=commit, jax=JAX))}",
    ]


def remote_script(line: str) -> str:
    """The --command of a printed gcloud ssh line, as the host's shell receives it."""
    (command,) = [a for a in shlex.split(line) if a.startswith("--command=")]
    return command[len("--command=") :]


# ------------------------------------------------------------------------------- usage


def test_help_prints_usage_without_any_environment(repo):
    out = launch(repo, "--help", dry=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: bash launch/tpu_pod.sh")
    for command in ("create", "setup", "run CONFIG WORKDIR", "logs", "status", "stop", "delete"):
        assert f"\n  {command}" in out.stdout
    assert launch(repo, "setup", "-h", dry=False).stdout == out.stdout


def test_no_arguments_is_an_error_with_usage(repo):
    out = launch(repo, dry=False)
    assert out.returncode == 2
    assert out.stderr.startswith("tpu_pod.sh: missing COMMAND\n\nusage:")
    assert out.stdout == ""


@pytest.mark.parametrize(
    "args, env, named",
    [
        (["setup", "--zone=us-east5-a"], {}, "missing the TPU name TPU: pass --tpu NAME"),
        (["run", "c.py", "/w"], {"ZONE": "z"}, "missing the TPU name TPU: pass --tpu NAME"),
        (["stop"], {"TPU": "t"}, "missing the zone ZONE: pass --zone ZONE"),
        (["create"], {"TPU": "t", "ZONE": "z"}, "missing the accelerator type ACCELERATOR"),
        (["run", "c.py"], {"TPU": "t", "ZONE": "z"}, "run needs WORKDIR"),
        (["launch"], {"TPU": "t", "ZONE": "z"}, "unknown command 'launch'"),
        (["logs", "--worker=x"], {"TPU": "t", "ZONE": "z"}, "--worker='x'"),
        (["stop", "--tpu"], {"ZONE": "z"}, "--tpu: expected one argument"),
        (["create", "--accelerator=v9z-8"], {"TPU": "t", "ZONE": "z"}, "pass --runtime-version"),
        (["run", "c.py", "/w", "--dry-run"], {"TPU": "t", "ZONE": "z"}, "'--dry-run' after"),
    ],
)
def test_a_missing_or_bad_value_is_named(repo, args, env, named):
    out = launch(repo, *args, env=env)
    assert out.returncode == 2, out
    assert named in out.stderr
    assert "\nusage: bash launch/tpu_pod.sh" in out.stderr
    assert out.stdout == ""  # nothing would have run


# ------------------------------------------------------------------------------ create


def test_create_v5e_8_tpu_vm(repo):
    out = launch(repo, "create", "--tpu=gspo-v5e", "--zone=us-west4-a", "--accelerator=v5e-8")
    assert out.returncode == 0, out.stderr
    assert out.stdout == (
        "gcloud compute tpus tpu-vm create gspo-v5e --zone=us-west4-a "
        "--accelerator-type=v5litepod-8 --version=v2-alpha-tpuv5-lite\n"
    )


def test_create_v5p_64_queued_spot_from_environment(repo):
    env = {"TPU": "gspo-v5p", "ZONE": "us-east5-a", "PROJECT": "my-proj", "ACCELERATOR": "v5p-64"}
    out = launch(repo, "create", "--queued", "--spot", env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout == (
        "gcloud compute tpus queued-resources create gspo-v5p --node-id=gspo-v5p "
        "--zone=us-east5-a --project=my-proj --accelerator-type=v5p-64 "
        "--runtime-version=v2-alpha-tpuv5 --spot\n"
    )
    best = launch(repo, "create", "--best-effort", env={**env, "QUEUED": "1"})
    assert best.stdout.startswith("gcloud alpha compute tpus queued-resources create gspo-v5p ")
    assert best.stdout.endswith(" --best-effort\n")
    assert launch(repo, "create", "--best-effort", env=env).returncode == 2  # not a TPU VM tier


@pytest.mark.parametrize(
    "accelerator, version",
    [
        ("v6e-8", "v2-alpha-tpuv6e"),
        ("v5p-8", "v2-alpha-tpuv5"),
        ("v5litepod-16", "v2-alpha-tpuv5-lite"),
        ("v4-32", "tpu-ubuntu2204-base"),
    ],
)
def test_runtime_version_follows_the_generation_unless_overridden(repo, accelerator, version):
    env = {"TPU": "t", "ZONE": "z", "ACCELERATOR": accelerator}
    out = launch(repo, "create", env=env)
    assert f" --accelerator-type={accelerator} --version={version}\n" in out.stdout
    out = launch(repo, "create", "--runtime-version=my-image", env=env)
    assert f" --accelerator-type={accelerator} --version=my-image\n" in out.stdout


# ------------------------------------------------------------------------------- setup


def test_setup_v5e_8_prints_the_exact_commands(repo):
    out = launch(repo, "setup", "--tpu=gspo-v5e", "--zone=us-west4-a", "--project=my-proj")
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == expected_setup(repo, "gspo-v5e", "us-west4-a", "my-proj")


def test_setup_v5p_64_prints_the_exact_commands_and_is_idempotent(repo):
    env = {"TPU": "gspo-v5p", "ZONE": "us-east5-a", "PROJECT": "my-proj"}
    first = launch(repo, "setup", env=env)
    assert first.returncode == 0, first.stderr
    assert first.stdout.splitlines() == expected_setup(repo, "gspo-v5p", "us-east5-a", "my-proj")
    # Again: the same commands, so the same fixed code/ directory is replaced, never nested.
    assert launch(repo, "setup", env=env).stdout == first.stdout


def test_setup_installs_the_jax_pin_of_the_shipped_commit(repo):
    requirements = repo / "requirements.txt"
    text = requirements.read_text().replace(f"jax=={JAX}\n", "jax==9.8.7\n")
    assert "jax==9.8.7" in text
    requirements.write_text(text)
    git(repo, "commit", "-qam", "bump jax")
    out = launch(repo, "setup", env={"TPU": "t", "ZONE": "z"})
    assert "JAX=9.8.7; " in remote_script(out.stdout.splitlines()[-1])
    # An uncommitted pin is not what ships: HEAD's pin is installed.
    requirements.write_text(text.replace("jax==9.8.7", "jax==1.2.3"))
    out = launch(repo, "setup", "--allow-dirty", env={"TPU": "t", "ZONE": "z"})
    assert "JAX=9.8.7; " in remote_script(out.stdout.splitlines()[-1])


def test_setup_refuses_uncommitted_changes_to_tracked_files(repo):
    (repo / "gspo_jax" / "__init__.py").write_text('"""edited"""\n')
    (repo / "notes.txt").write_text("untracked\n")
    out = launch(repo, "setup", env={"TPU": "t", "ZONE": "z"})
    assert out.returncode == 1
    assert "uncommitted changes (gspo_jax/__init__.py)" in out.stderr
    assert "--allow-dirty" in out.stderr
    assert out.stdout == ""
    out = launch(repo, "setup", "--allow-dirty", env={"TPU": "t", "ZONE": "z"})
    assert out.returncode == 0
    assert "warning: tracked files have uncommitted changes" in out.stderr
    assert "untracked files are not shipped: notes.txt" in out.stderr


def test_setup_install_python_installs_and_uses_python311_first(repo):
    out = launch(repo, "setup", "--install-python", env={"TPU": "t", "ZONE": "z"})
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) == 5
    install = remote_script(lines[0])
    assert install.startswith("PY=python3.11; APT=")
    assert '$APT install "$PY" "$PY-venv"' in install
    assert remote_script(lines[1]).startswith("R=gspo_jax; PY=python3.11; ")
    assert remote_script(lines[4]).startswith("R=gspo_jax; PY=python3.11; ")
    assert launch(repo, "setup", "--install-python", "--python=python3.12").returncode == 2


# --------------------------------------------------------------------------------- run

NASTY_CONFIG = "configs/gspo_paper.py:hf_path=/mnt/my models/Qwen3 0.6B,manual_dir=/d/it's"
NASTY_FLAGS = [
    '--config.data.system_prompt=Say "hi" & $(echo EXPANDED) `id` $HOME; exit 1',
    "--config.seed=7",
    "",
    "--config.log.name=a'b\\c|*",
]


def test_run_v5p_64_prints_the_exact_command(repo):
    env = {"TPU": "gspo-v5p", "ZONE": "us-east5-a", "PROJECT": "my-proj"}
    out = launch(
        repo, "run", "configs/gspo_paper.py", "/mnt/shared/runs/a", "--config.seed=1", env=env
    )
    assert out.returncode == 0, out.stderr
    script = (
        'R=gspo_jax; cd "$R/code" 2>/dev/null || { echo "gspo_jax: no code in $R/code on '
        '$(hostname): run setup first." >&2; exit 1; }; if [ -f ../run.pid ] && kill -0 '
        '"$(cat ../run.pid)" 2>/dev/null; then echo "gspo_jax: a run is already going on '
        '$(hostname) (pid $(cat ../run.pid)): stop it first (tpu_pod.sh stop)." >&2; exit 1; '
        'fi; echo "=== $(date -u +%Y-%m-%dT%H:%M:%SZ) commit $(cat COMMIT) ===" >> ../run.log; '
        f"export LIBTPU_INIT_ARGS='{DEFAULT_LIBTPU_INIT_ARGS}'; "
        'echo "LIBTPU_INIT_ARGS=$LIBTPU_INIT_ARGS" >> ../run.log; '
        r'setsid nohup sh -c "echo \$\$ > ../run.pid && exec \"\$0\" \"\$@\"" '
        "../venv/bin/python -m gspo_jax.main --config=configs/gspo_paper.py "
        "--workdir=/mnt/shared/runs/a --distributed --config.seed=1 >> ../run.log 2>&1 "
        '< /dev/null & echo "gspo_jax: started on $(hostname); log: $R/run.log"'
    )
    assert out.stdout == (
        "gcloud compute tpus tpu-vm ssh gspo-v5p --zone=us-east5-a --project=my-proj "
        f"--worker=all {shlex.quote('--command=' + script)}\n"
    )


@pytest.mark.parametrize(
    "args,env,exported",
    [
        (["--libtpu-init-args=--xla_a=1 --xla_b=2"], {}, "'--xla_a=1 --xla_b=2'"),
        ([], {"LIBTPU_INIT_ARGS": "--xla_c=3"}, "--xla_c=3"),
        (["--libtpu-init-args=none"], {}, "''"),
    ],
)
def test_run_passes_the_chosen_libtpu_init_args(repo, args, env, exported):
    out = launch(
        repo, *args, "run", "configs/default.py", "/mnt/x", env={"TPU": "t", "ZONE": "z", **env}
    )
    assert out.returncode == 0, out.stderr
    assert f"export LIBTPU_INIT_ARGS={exported}; " in shlex.split(out.stdout)[-1]


def test_run_arguments_survive_both_shells(repo):
    out = launch(
        repo, "run", NASTY_CONFIG, "/mnt/shared/run 1", *NASTY_FLAGS, env={"TPU": "t", "ZONE": "z"}
    )
    assert out.returncode == 0, out.stderr
    (line,) = out.stdout.splitlines()
    # local shell: the printed line -> gcloud's argv; host shell: --command -> the trainer's
    words = shlex.split(remote_script(line))
    start = words.index("gspo_jax.main") + 1
    trainer = words[start : words.index(">>", start)]
    assert trainer == [
        f"--config={NASTY_CONFIG}",
        "--workdir=/mnt/shared/run 1",
        "--distributed",
        *NASTY_FLAGS,
    ]


@pytest.mark.parametrize(
    "workdir, named",
    [("gs://bucket/run", "a gs:// path does not work yet"), ("runs/a", "must be an absolute")],
)
def test_run_rejects_workdirs_the_hosts_cannot_share(repo, workdir, named):
    out = launch(repo, "run", "configs/default.py", workdir, env={"TPU": "t", "ZONE": "z"})
    assert out.returncode == 2
    assert named in out.stderr
    assert out.stdout == ""


def test_logs_status_stop_delete_commands(repo):
    env = {"TPU": "t", "ZONE": "z"}
    logs = launch(repo, "logs", "--worker", "3", env=env).stdout
    assert logs == (
        "gcloud compute tpus tpu-vm ssh t --zone=z --worker=3 "
        """'--command=R=gspo_jax; tail -n 200 -F "$R/run.log"'\n"""
    )
    assert " --worker=0 " in launch(repo, "logs", env=env).stdout
    status = launch(repo, "status", "--queued", env=env).stdout.splitlines()
    assert status[0] == "gcloud compute tpus queued-resources describe t --zone=z"
    assert status[1].startswith("gcloud compute tpus tpu-vm ssh t --zone=z --worker=all ")
    stop = launch(repo, "stop", env=env).stdout
    assert stop.startswith("gcloud compute tpus tpu-vm ssh t --zone=z --worker=all '--command=")
    assert launch(repo, "delete", env=env).stdout == (
        "gcloud compute tpus tpu-vm delete t --zone=z\n"
    )
    assert launch(repo, "delete", "--yes", env={**env, "QUEUED": "1"}).stdout == (
        "gcloud compute tpus queued-resources delete t --zone=z --force --quiet\n"
    )
    assert launch(repo, "ssh", "--worker=all", "ls", "-la", "~", env=env).stdout == (
        "gcloud compute tpus tpu-vm ssh t --zone=z --worker=all '--command=ls -la ~'\n"
    )


# ---------------------------------------------------------------- a fake gcloud and host

FAKE_GCLOUD = """#!{python}
# A stand-in for gcloud: appends its argv to $FAKE_GCLOUD_LOG (one JSON list a line). With
# $FAKE_HOST set it also plays one TPU host whose home is that directory: `ssh --command=`
# runs the command there with bash, `scp` copies the file there.
import json, os, shutil, subprocess, sys

args = sys.argv[1:]
with open(os.environ["FAKE_GCLOUD_LOG"], "a") as f:
    f.write(json.dumps(args) + "\\n")
host = os.environ.get("FAKE_HOST")
if host and "ssh" in args:
    (command,) = [a[len("--command="):] for a in args if a.startswith("--command=")]
    env = dict(os.environ, HOME=host)
    sys.exit(subprocess.call(["bash", "-c", command], cwd=host, env=env))
if host and "scp" in args:
    source, target = [a for a in args[args.index("scp") + 1:] if not a.startswith("--")]
    shutil.copy(source, os.path.join(host, target.split(":", 1)[1]))
"""

# The host's python3 (and, copied by `-m venv`, its venv's python): logs each call to
# $FAKE_PY_LOG, claims Python < 3.11 when FAKE_PY_OLD=1, and runs FAKE_TRAINER for the
# trainer.
FAKE_PYTHON = """#!/bin/bash
echo "$*" >> "$FAKE_PY_LOG"
case "$1 $2" in
  "-c import sys"*) [ "${{FAKE_PY_OLD:-0}}" = 1 ] && exit 1; exit 0 ;;
  "-c import ensurepip"*) exit 0 ;;
  "-c import jax"*) echo fake; exit 0 ;;
  "--version ") echo "Python 3.10.12"; exit 0 ;;
  "-m venv") mkdir -p "$3/bin" && cp "$0" "$3/bin/python"; exit 0 ;;
  "-m pip") exit 0 ;;
  "-m gspo_jax.main") exec {python} "$FAKE_TRAINER" "$@" ;;
esac
echo "fake python: unexpected $*" >&2
exit 3
"""

# The trainer: records its argv (JSON) in $FAKE_TRAINER_ARGV, then stays up like a run and
# notes a SIGTERM in $FAKE_TRAINER_ARGV.signal.
FAKE_TRAINER = """import json, os, signal, sys, time

out = os.environ["FAKE_TRAINER_ARGV"]


def on_term(signum, frame):
    with open(out + ".signal", "w") as f:
        f.write("TERM")
    sys.exit(143)


signal.signal(signal.SIGTERM, on_term)
with open(out + ".env", "w") as f:
    f.write(os.environ.get("LIBTPU_INIT_ARGS", "<unset>"))
with open(out + ".tmp", "w") as f:
    json.dump(sys.argv[1:], f)
os.replace(out + ".tmp", out)  # whole, for the test polling it
time.sleep(120)
"""


@pytest.fixture
def fake(repo, tmp_path):
    """PATH with the fake gcloud, the fake host's directory, and the files they write."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    gcloud = bin_dir / "gcloud"
    gcloud.write_text(FAKE_GCLOUD.format(python=sys.executable))
    python = bin_dir / "fake-python3"
    python.write_text(FAKE_PYTHON.format(python=shlex.quote(sys.executable)))
    for f in (gcloud, python):
        f.chmod(0o755)
    trainer = bin_dir / "fake_trainer.py"
    trainer.write_text(FAKE_TRAINER)
    host = tmp_path / "host"
    host.mkdir()
    files = {
        "gcloud_log": tmp_path / "gcloud.jsonl",
        "py_log": tmp_path / "python.log",
        "trainer_argv": tmp_path / "trainer.json",
    }
    env = {
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "TPU": "gspo-v5p",
        "ZONE": "us-east5-a",
        "HOST_PYTHON": str(python),
        "FAKE_GCLOUD_LOG": str(files["gcloud_log"]),
        "FAKE_PY_LOG": str(files["py_log"]),
        "FAKE_TRAINER_ARGV": str(files["trainer_argv"]),
        "FAKE_TRAINER": str(trainer),
    }
    return {"env": env, "host": host, **files}


def gcloud_calls(fake) -> list[list[str]]:
    path = fake["gcloud_log"]
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line) for line in lines]


def test_setup_runs_what_it_prints(repo, fake):
    env = fake["env"]  # no FAKE_HOST: gcloud only records
    printed = launch(repo, "setup", env=env).stdout.splitlines()
    out = launch(repo, "setup", env=env, dry=False)
    assert out.returncode == 0, out.stderr
    assert [f"+ {line}" for line in printed] == [
        x for x in out.stderr.splitlines() if x.startswith("+ ")
    ]
    gcloud_printed = [shlex.split(line)[1:] for line in printed if line.startswith("gcloud ")]
    assert gcloud_calls(fake) == gcloud_printed
    # The tarball holds exactly the committed files: no .venv, no untracked or ignored ones.
    with tarfile.open(tarball_of(repo)) as tar:
        shipped = sorted(m.name for m in tar.getmembers() if m.isfile())
    assert shipped == sorted(git(repo, "ls-files").split())


def test_run_runs_what_it_prints(repo, fake):
    env = fake["env"]
    args = ["run", NASTY_CONFIG, "/mnt/shared/run 1", *NASTY_FLAGS]
    printed = launch(repo, *args, env=env).stdout.splitlines()
    assert launch(repo, *args, env=env, dry=False).returncode == 0
    assert gcloud_calls(fake) == [shlex.split(line)[1:] for line in printed]


def test_an_old_host_python_stops_setup_before_the_upload(repo, fake):
    env = {**fake["env"], "FAKE_HOST": str(fake["host"]), "FAKE_PY_OLD": "1"}
    out = launch(repo, "setup", env=env, dry=False)
    assert out.returncode == 1
    assert "the pinned jax needs Python >= 3.11, but" in out.stderr
    assert "is Python 3.10.12. Re-run setup with --install-python" in out.stderr
    assert len(gcloud_calls(fake)) == 1  # the check only: nothing copied or installed
    assert not (fake["host"] / "gspo_jax" / "code").exists()


@pytest.fixture
def subreaper():
    """Adopt orphaned descendants (the fake run outlives its ssh) so they can be reaped.

    This machine's init does not reap zombies, and `kill -0` succeeds on a zombie.
    """
    if not sys.platform.startswith("linux"):
        pytest.skip("needs Linux prctl")
    libc = ctypes.CDLL(None, use_errno=True)
    pr_set_child_subreaper = 36
    if libc.prctl(pr_set_child_subreaper, 1, 0, 0, 0):
        pytest.skip("prctl(PR_SET_CHILD_SUBREAPER) refused")
    yield
    libc.prctl(pr_set_child_subreaper, 0, 0, 0, 0)


def _reap_when_dead(pid: int, done: threading.Event) -> None:
    while not done.is_set():
        try:
            if os.waitpid(pid, os.WNOHANG)[0]:
                return
        except ChildProcessError:
            return
        time.sleep(0.05)


@pytest.mark.skipif(shutil.which("setsid") is None, reason="needs setsid (util-linux)")
def test_setup_run_status_stop_on_a_fake_host(repo, fake, subreaper):
    env = {**fake["env"], "FAKE_HOST": str(fake["host"])}
    root = fake["host"] / "gspo_jax"

    out = launch(repo, "setup", env=env, dry=False)
    assert out.returncode == 0, out.stderr
    shipped = sorted(str(p.relative_to(root / "code")) for p in (root / "code").rglob("*"))
    assert shipped == sorted(git(repo, "ls-files").split() + ["COMMIT", "gspo_jax", "launch"])
    assert (root / "code" / "COMMIT").read_text() == commit_of(repo) + "\n"
    (root / "venv" / "kept").write_text("")
    py_calls = fake["py_log"].read_text()
    assert f"-m pip install -q jax[tpu]=={JAX} -r code/requirements.txt\n" in py_calls
    assert "-m pip install -q --no-deps -e code\n" in py_calls

    # A second setup after a commit replaces the code in place: the deleted file is gone,
    # nothing nests, the venv stays.
    git(repo, "rm", "-q", "gspo_jax/__init__.py")
    (repo / "gspo_jax").mkdir(exist_ok=True)  # git rm took the emptied directory
    (repo / "gspo_jax" / "sampling.py").write_text("")
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "second")
    out = launch(repo, "setup", env=env, dry=False)
    assert out.returncode == 0, out.stderr
    assert sorted(p.name for p in (root / "code" / "gspo_jax").iterdir()) == ["sampling.py"]
    assert sorted(p.name for p in root.iterdir()) == ["code", "venv"]
    assert (root / "venv" / "kept").exists()
    assert (root / "code" / "COMMIT").read_text() == commit_of(repo) + "\n"

    # run: the trainer gets exactly the argv typed locally, through both shells.
    out = launch(repo, "run", NASTY_CONFIG, "/mnt/shared/run 1", *NASTY_FLAGS, env=env, dry=False)
    assert out.returncode == 0, out.stderr
    deadline = time.monotonic() + 20
    while not fake["trainer_argv"].exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    pid = int((root / "run.pid").read_text())
    done = threading.Event()
    reaper = threading.Thread(target=_reap_when_dead, args=(pid, done), daemon=True)
    reaper.start()
    try:
        assert json.loads(fake["trainer_argv"].read_text()) == [
            "-m",
            "gspo_jax.main",
            f"--config={NASTY_CONFIG}",
            "--workdir=/mnt/shared/run 1",
            "--distributed",
            *NASTY_FLAGS,
        ]
        log = (root / "run.log").read_text()
        assert log.startswith("=== ") and f" commit {commit_of(repo)} ===\n" in log
        # the trainer runs with the launcher's XLA:TPU flags, and the log says which
        assert Path(f"{fake['trainer_argv']}.env").read_text() == DEFAULT_LIBTPU_INIT_ARGS
        assert f"LIBTPU_INIT_ARGS={DEFAULT_LIBTPU_INIT_ARGS}\n" in log

        status = launch(repo, "status", env=env, dry=False)
        assert f": running (pid {pid}, commit {commit_of(repo)})" in status.stdout
        again = launch(repo, "run", "configs/default.py", "/mnt/x", env=env, dry=False)
        assert again.returncode == 1
        assert "a run is already going on" in again.stderr
        blocked = launch(repo, "setup", env=env, dry=False)
        assert blocked.returncode == 1 and "stop it first" in blocked.stderr

        stop = launch(repo, "stop", env=env, dry=False)
        assert stop.returncode == 0, stop.stderr
        assert f": stopped run {pid}" in stop.stdout
        assert Path(f"{fake['trainer_argv']}.signal").read_text() == "TERM"  # not a SIGKILL
        reaper.join(timeout=10)
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
        assert ": no run going on" in launch(repo, "status", env=env, dry=False).stdout
    finally:
        done.set()
        try:
            os.killpg(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
