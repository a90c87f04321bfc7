"""What a new user meets on a first run (docs/failures.md, "First-run messages"): no
TFDS "Downloading" line for data that is not downloaded, no PyTorch / libtpu notices on a
CPU run, a word while the first step compiles and while it evaluates, exported weights
readable by the group, one clean line for a bad flag or an aot run without libtpu, and a
config error before JAX starts."""

import logging
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import main_command

ROOT = Path(__file__).resolve().parents[2]


def _cpu_env(**extra) -> dict:
    """The environment of a plain CPU run: no JAX_PLATFORMS (JAX probes for a TPU, as a
    new user's run does), no libtpu on the path."""
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "PYTHONPATH")}
    return env | {"PYTHONPATH": str(ROOT)} | extra


def _umask_mode() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_config_error_is_the_only_line_and_comes_before_jax_starts(tmp_path):
    """Before: the PyTorch and libtpu notices, the JAX line, then the error, after JAX's
    backends (and here the distributed runtime, which waits for a coordinator that never
    answers: > 60 s) had started. Now: the error alone, before any of it."""
    flags = [
        "--config.clip_low=-1",
        f"--coordinator=127.0.0.1:{_closed_port()}",
        "--num_processes=2",
        "--process_id=1",
    ]
    proc = subprocess.run(
        main_command(tmp_path / "run", *flags),
        cwd=ROOT,
        env=_cpu_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.splitlines() == [
        "gspo_jax: error: config.clip_low=-1.0 must be a finite number in [0, 1]"
    ], proc.stderr[-3000:]


@pytest.mark.parametrize(
    "flag, line",
    [
        ("--config.log.tensorboard=maybe", "--config.log.tensorboard=maybe: must be true or false"),
        ("--debug=maybe", "--debug=maybe: must be true or false"),
        ("--config.num_steps=abc", "--config.num_steps=abc: must be an integer"),
        ("--config.clip_low=abc", "--config.clip_low=abc: must be a number"),
        (
            "--config.num_step=3",
            (
                "--config.num_step=3: the config has no field 'num_step'; "
                'did you mean "num_steps" instead of "num_step"?'
            ),
        ),
    ],
)
def test_a_bad_flag_is_one_line_naming_the_flag_and_value(tmp_path, flag, line):
    """Before: "('Non-boolean argument to boolean flag', 'maybe')", "invalid literal for
    int() with base 10", and for an unknown field only "'num_step'"."""
    proc = subprocess.run(
        main_command(tmp_path / "run", flag),
        cwd=ROOT,
        env=_cpu_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.splitlines() == [f"gspo_jax: error: {line}"]


def test_a_number_without_a_range_says_finite_once():
    from configs import default
    from gspo_jax.config.validate import ConfigError, validate

    config = default.get_config()
    config.entropy_coef = float("inf")
    with pytest.raises(ConfigError) as e:
        validate(config)
    assert str(e.value) == "config.entropy_coef=inf must be a finite number"  # not "... finite"


def test_cpu_runs_drop_the_pytorch_and_libtpu_notices_only():
    code = (
        "import logging, sys\n"
        "from gspo_jax.notices import quiet_known_notices\n"
        "if sys.argv[1] == 'quiet':\n"
        "    quiet_known_notices()\n"
        "logging.basicConfig(level=logging.INFO)\n"
        "import transformers, jax\n"
        "jax.devices()\n"
        "logging.getLogger('jax._src.xla_bridge').info(\n"
        "    \"Unable to initialize backend 'tpu': TPU initialization failed\")\n"
    )
    loud, quiet = (
        subprocess.run(
            [sys.executable, "-c", code, mode],
            cwd=ROOT,
            env=_cpu_env(),
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        for mode in ("loud", "quiet")
    )
    assert loud.returncode == 0 and quiet.returncode == 0, loud.stderr + quiet.stderr
    for notice in ("PyTorch was not found", "libtpu.so: cannot open shared object file"):
        if notice not in loud.stderr:  # torch or libtpu installed here: nothing to drop
            continue
        assert notice not in quiet.stderr, quiet.stderr
    # A libtpu that is there but fails is a real problem: it still shows.
    assert "TPU initialization failed" in quiet.stderr


def test_preparing_a_dataset_says_nothing_is_downloaded(tmp_path, capfd, caplog):
    from gspo_jax.data.build import build_dataset

    with caplog.at_level(logging.INFO, logger="gspo_jax.data.build"):
        sources = build_dataset("arithmetic", "add2", data_dir=tmp_path)
    assert len(sources["test"]) > 0
    out, err = capfd.readouterr()
    assert "Downloading" not in out + err and "downloaded" not in out + err
    assert "preparing dataset arithmetic/add2 in" in caplog.text
    assert "nothing is downloaded" in caplog.text


def test_exported_weights_get_the_umask_mode(tmp_path):
    """safetensors wrote model.safetensors 0600 (a renamed private temp file) beside 0644
    files: teammates on a shared filesystem could not read the weights."""
    from gspo_jax import models

    cfg, params = models.load_pretrained(ROOT / "tests" / "fixtures" / "models" / "qwen3")
    models.save_pretrained(cfg, params, tmp_path / "hf")
    for name in ("model.safetensors", "config.json"):
        mode = (tmp_path / "hf" / name).stat().st_mode & 0o777
        assert mode == _umask_mode(), f"{name}: {oct(mode)}"


def test_aot_without_libtpu_is_one_line_saying_how_to_install_it(tmp_path):
    env = _cpu_env()
    found = subprocess.run([sys.executable, "-c", "import libtpu"], env=env, check=False)
    if found.returncode == 0:
        pytest.skip("libtpu is importable here")
    proc = subprocess.run(
        [sys.executable, "-m", "tools.aot", "--config=configs/default.py", "--topology=v5e:2x2"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith("tools.aot: error: libtpu is not installed")
    assert "pip install -r requirements-tpu.txt" in lines[0] and '"jax[tpu]==' in lines[0]


class _Writer:
    path = "/nonexistent"

    def resume(self, step):
        pass

    def write(self, step, values):
        pass

    def close(self):
        pass


def test_an_evaluation_is_said_on_the_bar_and_the_first_in_the_log(caplog):
    """The first evaluation (which compiles the greedy sampler) used to leave the bar frozen
    at 0/N for minutes without a word. The first RL step's compile is said the same way
    (`RL (compiling)`, "compiling the RL step (first step only)"), in train()."""
    import types

    from gspo_jax.trainer import loop

    seen = []

    def evaluator(params):
        seen.append(report.bar.desc)
        return {"eval/accuracy": 0.5}

    evaluator.spec = types.SimpleNamespace(save_per_problem=False)

    schedule = types.SimpleNamespace(updates_per_step=1, progress_bar=True, num_steps=4)
    trainer = types.SimpleNamespace(
        writer=_Writer(), schedule=schedule, is_lead=True, evaluator=evaluator
    )
    report = loop._Reporter(trainer, initial=0)
    with caplog.at_level(logging.INFO, logger=loop.__name__):
        assert loop._evaluate(trainer, report, None, 0) == {"eval/accuracy": 0.5}
        loop._evaluate(trainer, report, None, 2)
    report.close()
    assert seen == ["RL (evaluating)", "RL (evaluating)"]
    assert report.bar.desc == "RL"
    said = [r.getMessage() for r in caplog.records if "evaluating" in r.getMessage()]
    first = "RL step 0: evaluating on the held-out split (the first evaluation compiles the"
    assert said == [f"{first} greedy sampler)"]


def test_the_first_rl_step_says_it_is_compiling(monkeypatch, caplog):
    """train() on stand-ins for the trainer's pieces: the compile line comes once, before
    the first RL step, and the bar reads `RL (compiling)` while that step runs."""
    import dataclasses
    import types

    from gspo_jax.trainer import loop
    from gspo_jax.trainer.io import checkpoint

    @dataclasses.dataclass(frozen=True)
    class State:
        step: int
        train: types.SimpleNamespace
        origin: str = "stand-in"

    bars = []

    def one_step(trainer, state):
        bars.append(report_bar[0].desc if report_bar else None)
        train = types.SimpleNamespace(step=state.train.step + 1, params=None)
        return dataclasses.replace(state, step=state.step + 1, train=train), {}

    report_bar = []
    real_reporter = loop._Reporter

    def reporter(trainer, *, initial):
        report = real_reporter(trainer, initial=initial)
        report_bar.append(report.bar)
        return report

    for name in ("save", "check", "finish"):
        monkeypatch.setattr(checkpoint, name, lambda *a, **k: None)
    monkeypatch.setattr(loop, "rl_step", one_step)
    monkeypatch.setattr(loop, "_Reporter", reporter)

    class Evaluator:
        spec = types.SimpleNamespace(every_steps=0, save_per_problem=False)

        def __call__(self, params):
            return {"eval/accuracy": 0.0}

    schedule = types.SimpleNamespace(
        num_steps=3,
        checkpoint_every=0,
        max_all_skipped_steps=0,
        updates_per_step=1,
        progress_bar=True,
        export_hf=False,
        plot=False,
        profile_steps=(),
    )
    trainer = types.SimpleNamespace(
        schedule=schedule,
        writer=_Writer(),
        is_lead=True,
        evaluator=Evaluator(),
        manager=types.SimpleNamespace(all_steps=list),
        workdir="/nonexistent",
        rollouts=types.SimpleNamespace(spec=types.SimpleNamespace(dynamic_sampling=False)),
    )
    state = State(step=0, train=types.SimpleNamespace(step=0, params=None))
    with caplog.at_level(logging.INFO, logger=loop.__name__):
        loop.train(trainer, state)
    said = [r.getMessage() for r in caplog.records if "compiling" in r.getMessage()]
    assert said == ["RL step 1: compiling the RL step (first step only)"]
    assert bars == ["RL (compiling)", "RL", "RL"]
