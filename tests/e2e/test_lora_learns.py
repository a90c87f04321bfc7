"""GSPO learns through LoRA adapters alone on the CPU default (configs/default.py), as a user
runs it: `python -m gspo_jax.main` with `model.lora_rank=8` from the default's warm-started
model (tests/fixtures/models/default_warm_start, made by make_default_warm_start.py: the
shipped base scores 36.2 % held out), 25 RL steps, held-out accuracy at the start and end.

On the development machine the 250-step LoRA run of the default config (docs/lora.md) went
36.2 % -> 44.0 % (step 25) -> 48.2 % (50) -> 50.6 % (250), and this test's 25-step run
36.2 % -> 44.0 % (62 s; 50 steps took 103-166 s); full fine-tuning goes 36.2 % -> 52.6 %.
The threshold, +3 points on 500 held-out problems after 25 steps, sits well below that gain
(+7.8) and above what
an update that learned nothing would show (0 points: the policy unchanged; a paired difference
on 500 problems has a standard error of about 2 points at most). The trajectory's last bits
differ across CPUs; its gain should not.
"""

import json
import os
import subprocess

from helpers import main_command

FIXTURE = os.path.join(
    os.path.dirname(os.path.dirname(__file__)), "fixtures", "models", "default_warm_start"
)


def test_gspo_with_lora_raises_held_out_accuracy_on_the_default(tmp_path):
    workdir = tmp_path / "run"
    cmd = main_command(
        workdir,
        f"--config.model.hf_path={FIXTURE}",
        "--config.model.lora_rank=8",
        "--config.optim.learning_rate=1e-3",
        "--config.num_steps=25",
        "--config.eval.every_steps=0",  # held-out accuracy at the start and the end only
        "--config.checkpoint.every_steps=0",
        f"--config.data.data_dir={tmp_path / 'data'}",
        "--config.log.progress_bar=false",
        "--config.log.plot=false",
    )
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads((workdir / "summary.json").read_text())
    assert "LoRA adapters of rank 8" in summary["origin"]
    assert os.path.isdir(summary["export_adapter"])
    gain = summary["eval_end"] - summary["eval_start"]
    assert gain >= 0.03, (summary["eval_start"], summary["eval_end"])
