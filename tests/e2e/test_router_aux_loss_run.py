"""`model.router_aux_loss_coef` through `python -m gspo_jax.main`: the tiny Qwen3-MoE
config (configs/moe_tiny.py), warm start and one RL step, logs a finite, positive
`policy/router_aux_loss` (k = 2 of E = 8 experts: 2 at uniform routing, at most 8)."""

import math
import subprocess

from helpers import TINY_MODEL, main_command, metrics_by_step


def test_the_router_aux_loss_is_logged(tmp_path):
    workdir = tmp_path / "run"
    cmd = main_command(
        workdir,
        f"--config.data.data_dir={tmp_path / 'data'}",
        *TINY_MODEL,
        "--config.model.moe_intermediate_size=32",
        "--config.model.router_aux_loss_coef=0.01",
        "--config.num_steps=1",
        "--config.rollout_batch_size=4",
        "--config.num_return_sequences_in_group=4",
        "--config.num_mini_batches=2",
        "--config.eval.num_prompts=4",
        "--config.eval.batch_size=4",
        "--config.eval.every_steps=0",
        "--config.reward.num_workers=0",
        "--config.checkpoint.every_steps=0",
        config="configs/moe_tiny.py",
    )
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    m = metrics_by_step(workdir)[1]
    aux = m["policy/router_aux_loss"]
    assert math.isfinite(aux) and 0 < aux <= 8  # E · Σ F·P <= E (F_e <= 1, Σ P = 1)
    assert math.isfinite(m["updates/router_aux_loss/0"])
    assert math.isfinite(m["updates/router_aux_loss/1"])
