"""The benchmarks a user runs still run: `benchmarks/rl_step.py --preset=trl_anchor`
(one whole RL step of the TRL anchor workload, by phase, with a profile of its train step) and
`benchmarks/train_packing.py` (its JSON keys).

No timing is asserted (the suite's machine is shared; speed targets live in benchmarks/):
only that every phase ran, the report is complete and its ratios are sane numbers. A merge
once broke this script unnoticed (its batch still used a renamed field)."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_trl_anchor_whole_step_runs_and_reports_every_phase(tmp_path):
    # TMPDIR: the profile's trace directory lands in the test's own temporary directory.
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu", TMPDIR=str(tmp_path))
    env.pop("XLA_FLAGS", None)  # one CPU device, as a user runs it
    # --compare: a TRL report as trl_anchor.py prints it last (its numbers made up here).
    trl = {"trl": "1.16.0", "threads": 2, "matmul_tflops_measured": 0.3}
    trl.update({"step/step_s": 1.0, "step/generation_s": 0.5, "step/score_adv_s": 0.002})
    trl.update({"step/train_s": 0.498, "step/train_flops_over_matmul": 0.4})
    trl["step/step_flops_over_matmul"] = 0.3
    (tmp_path / "trl.txt").write_text("step/step_s  1.0\n" + json.dumps(trl) + "\n")
    out = subprocess.run(
        [
            sys.executable,
            "benchmarks/rl_step.py",
            "--preset=trl_anchor",
            "--reps=1",
            "--profile",
            f"--compare={tmp_path / 'trl.txt'}",
        ],
        check=False,
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["preset"] == "trl_anchor" and report["config"]["num_layers"] == 4
    phases = ("step", "sample", "score", "advantages", "train")
    for phase in phases:
        assert report[f"step/{phase}_s"] > 0, phase
    parts = sum(report[f"step/{p}_s"] for p in phases[1:])
    assert parts == pytest.approx(report["step/step_s"], rel=0.05)  # the phases add up
    # 4 prompts x 8 samples x 64 tokens, a random model: nearly no EOS
    assert 1024 < report["step/generated_tokens"] <= 2048
    for key in ("train", "sample", "step"):
        assert 0 < report[f"step/{key}_flops_over_matmul"] < 1.5, key
    # The prompt is computed once per group: fewer FLOPs than the repeated-prompt count.
    assert (
        report["step/train_flops_over_matmul"]
        < report["step/train_repeated_prompt_flops_over_matmul"]
    )
    # --profile: the train step's ops by time, and categories that add up to 100%.
    assert "Train step by XLA op" in out.stdout
    shares = re.findall(
        r"^\s+([\d.]+)%\s+(\D.*)$", out.stdout.split("by category:")[1], re.MULTILINE
    )
    names = [name for _, name in shares]
    assert "weight matmuls" in names and "elementwise and other" in names
    assert sum(float(s) for s, _ in shares) == pytest.approx(100, abs=0.5)
    # --compare: the phase table with TRL's figures beside ours, and the targets.
    step = report["step/step_s"]
    assert f"| whole RL step | {step:.3f} s | 1.000 s | {step:.2f}x |" in out.stdout
    assert "| train step (forward + backward + optimizer) |" in out.stdout
    assert "target: train step >= 0.70 of the matmul rate: " in out.stdout
    verdict = "met" if step <= 0.5 else "not met"
    assert f"target: whole RL step <= 0.5x TRL's: {verdict} ({step:.2f}x)" in out.stdout


def test_calibrate_roofline_runs_and_writes_its_json(tmp_path):
    """benchmarks/calibrate_roofline.py at a tiny size: every function predicted and
    measured (no timing asserted: the machine is shared)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)  # the benchmark's own flags, normal optimisation (not -O0)
    out = tmp_path / "cal.json"
    proc = subprocess.run(
        [
            sys.executable,
            "benchmarks/calibrate_roofline.py",
            "--hidden_size=64",
            "--num_layers=1",
            "--response_length=16",
            "--prompt_length=16",
            "--batch=1",
            "--group=2",
            "--vocab=512",
            "--reps=1",
            f"--json={out}",
        ],
        check=False,
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert {"matmul_flops", "bandwidth", "first_touch"} <= set(report["cpu"])
    functions = [r["function"] for r in report["rows"]]
    assert functions == ["train step", "logprobs", "decode (16 steps)"]
    for r in report["rows"]:
        assert {"function", "predicted_s", "measured_s"} <= set(r)
        assert r["predicted_s"] > 0 and r["measured_s"] > 0
        assert r["executed_flops"] > 0 and r["hbm_bytes"] > 0


def test_train_packing_writes_the_issue_keys(tmp_path):
    """benchmarks/train_packing.py at a toy size writes {long_tail, uniform} with real tokens/s
    of both steps and the packed real fraction (no timing asserted)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    path = tmp_path / "packing.json"
    args = ["--groups=2", "--group=4", "--prompt-length=8", "--response-length=32", "--reps=1"]
    out = subprocess.run(
        [sys.executable, "benchmarks/train_packing.py", *args, f"--json={path}"],
        check=False,
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(path.read_text())
    for batch in ("long_tail", "uniform"):
        for key in ("packed_real_tokens_per_s", "padded_real_tokens_per_s"):
            assert report[batch][key] > 0, (batch, key)
        assert 0 < report[batch]["packed_real_fraction"] <= 1
    assert report["long_tail"]["packed_real_fraction"] > report["long_tail"]["padded_real_fraction"]
    assert report["uniform"]["packed_rows_per_micro_batch"] == 0  # full length: the padded step
