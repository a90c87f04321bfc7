"""Routing Replay (paper §5.3) end to end: the tiny Qwen3-MoE config through `main`, replay's
effect on an off-policy mini-batch's gradient, the first update reproducing π_old's
routing, and the logged expert-change rate against `routing_checks.routing_disagreement`."""

import dataclasses
import struct
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import TINY_MODEL, main_command, metrics_by_step
from routing_checks import routing_disagreement
from step_helpers import T, compiled_step, optimizer, step_config_for, train_batch, train_state

from gspo_jax import models
from gspo_jax.train_step import response_logprobs
from gspo_jax.train_step.step import _mini_batch_grads

MOE_FIXTURE = "tests/fixtures/models/qwen3_moe"
GRPO = {"importance_sampling": "token", "clip_low": 0.2, "clip_high": 0.27}


@pytest.fixture(scope="module")
def moe():
    return models.load_pretrained(MOE_FIXTURE)


def _with_old_policy(sc, params, batch):
    """`batch` as the train step's π_old pass leaves it: π_old's log-probs and routing."""
    logp, _, routing_MBLX = response_logprobs(
        sc, params, batch["tokens"], batch["attention_mask"], T
    )
    return {**batch, "old_logprobs": logp, "old_routing": jnp.moveaxis(routing_MBLX, 0, 1)}


def _rel_diff(a, b) -> float:
    num = sum(float(jnp.sum((x - y) ** 2)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
    den = sum(float(jnp.sum(y**2)) for y in jax.tree.leaves(b))
    return (num / den) ** 0.5


def test_replay_changes_the_gradient_of_an_off_policy_mini_batch(moe):
    """GRPO's gradient at θ_1 (after one update) on the rollout of θ_old: with replay the
    experts θ_old chose run, without it θ_1's own; where those differ, so does the
    gradient. At θ_old itself the two coincide (replaying the router's own choice)."""
    cfg, params = moe
    sc = step_config_for(cfg, num_mini_batches=1, horizon=T, **GRPO)
    tx = optimizer()
    batch = train_batch(cfg, params, sc)
    moved = compiled_step(sc, tx)(train_state(params, tx), batch)[0].params  # θ_1: one Adam update
    changed = routing_disagreement(cfg, params, moved, batch["tokens"], batch["attention_mask"])
    assert changed > 0.01  # the update moved some routing decisions: off-policy routing
    mini = _with_old_policy(sc, params, batch)
    grads = jax.jit(_mini_batch_grads, static_argnums=0)
    replay, free = dataclasses.replace(sc, routing_replay=True), sc
    off_rr, off_free = grads(replay, moved, mini)[0], grads(free, moved, mini)[0]
    assert _rel_diff(off_rr, off_free) > 1e-2
    on_rr, on_free = grads(replay, params, mini)[0], grads(free, params, mini)[0]
    assert _rel_diff(on_rr, on_free) < 1e-5


def test_with_replay_the_first_update_reproduces_pi_olds_routing_exactly(moe):
    """bf16 compute, 2 micro-batches per mini-batch: update 0 runs at π_old's params with
    π_old's routing, and its own router picks exactly those experts (change 0), so its
    log-probs are π_old's bit for bit (ratios exactly 1). Later updates move the router."""
    cfg, params = moe
    cfg = dataclasses.replace(cfg, dtype="bfloat16")
    sc = step_config_for(
        cfg, num_mini_batches=2, micro_batch_size=4, horizon=T, routing_replay=True, **GRPO
    )
    tx = optimizer()
    batch = train_batch(cfg, params, sc)
    _, m = compiled_step(sc, tx)(train_state(params, tx), batch)
    m = jax.device_get(m)
    assert m["updates/expert_change"][0] == 0
    assert m["updates/ratio_min"][0] == 1 and m["updates/ratio_max"][0] == 1
    assert m["ratio_noise_floor"] == 0
    assert m["updates/expert_change"][1] > 0  # would pick others: replay is doing something


def test_logged_expert_change_is_routing_disagreement_with_pi_old(moe):
    """updates/expert_change at update 1 (no replay) equals `routing_checks.routing_disagreement`
    between π_old and the params after one update, an independent computation."""
    cfg, params = moe
    tx = optimizer()
    one = step_config_for(cfg, num_mini_batches=1, horizon=T, **GRPO)
    two = dataclasses.replace(one, ppo_epochs=2)  # update 1: the same batch, at θ_1
    batch = train_batch(cfg, params, one)
    theta_1 = compiled_step(one, tx)(train_state(params, tx), batch)[0].params
    _, m = compiled_step(two, tx)(train_state(params, tx), batch)
    expected = routing_disagreement(cfg, params, theta_1, batch["tokens"], batch["attention_mask"])
    assert expected > 0
    np.testing.assert_allclose(m["updates/expert_change"][1], expected, rtol=1e-5)
    assert m["updates/expert_change"][0] == 0


def test_moe_tiny_grpo_with_replay_through_main(tmp_path):
    """configs/moe_tiny.py (GRPO + Routing Replay) for 2 RL steps through `gspo_jax.main`:
    every update's expert change, ratio range and clip fractions reach metrics.jsonl,
    and the plot is drawn. With `model.router_aux_loss_coef` the load-balancing loss is
    logged too: finite, in (0, E] (E · Σ F·P <= E; k = 2 of E = 8 experts: 2 at uniform
    routing)."""
    workdir = tmp_path / "run"
    cmd = main_command(
        workdir,
        f"--config.data.data_dir={tmp_path / 'data'}",
        *TINY_MODEL,
        "--config.model.moe_intermediate_size=32",
        "--config.num_steps=2",
        "--config.rollout_batch_size=8",
        "--config.num_return_sequences_in_group=4",
        "--config.eval.num_prompts=8",
        "--config.eval.batch_size=8",
        "--config.reward.num_workers=0",
        "--config.checkpoint.every_steps=0",
        "--config.model.router_aux_loss_coef=0.01",
        config="configs/moe_tiny.py:algo=grpo,routing_replay=true",
    )
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = metrics_by_step(workdir)
    for step in (1, 2):
        m = rows[step]
        assert m["updates/expert_change/0"] == 0  # replayed, at π_old's params
        assert m["updates/ratio_min/0"] == m["updates/ratio_max/0"] == 1
        for u in range(4):  # the paper's 4 mini-batches per rollout
            assert 0 <= m[f"updates/expert_change/{u}"] <= 1
            assert m[f"updates/ratio_min/{u}"] <= m[f"updates/ratio_mean/{u}"]
            assert m[f"updates/ratio_mean/{u}"] <= m[f"updates/ratio_max/{u}"]
            assert 0 <= m[f"updates/clipfrac/{u}"] <= 1
            assert 0 <= m[f"updates/clipfrac_seq/{u}"] <= 1
        assert m["policy/ratio_noise_floor"] == 0
        assert m["sampler/logprob_gap_mean"] >= 0
        expected = np.mean([m[f"updates/expert_change/{u}"] for u in range(4)])
        assert m["policy/expert_change"] == pytest.approx(expected, rel=1e-5)
        assert 0 < m["policy/router_aux_loss"] <= 8
        assert all(np.isfinite(m[f"updates/router_aux_loss/{u}"]) for u in range(4))
    assert (workdir / "curves.png").exists()
    tags = _tensorboard_tags(workdir / "tb")
    for key in ("updates/expert_change/1", "updates/clipfrac_seq/3", "policy/ratio_noise_floor"):
        assert key in tags, key


def _tensorboard_tags(tb_dir) -> set[str]:
    """Scalar tags in a TensorBoard event directory (TFRecord framing: length, crc, data,
    crc; each record an Event proto)."""
    from tensorboardX.proto import event_pb2

    tags = set()
    for path in tb_dir.iterdir():
        data = path.read_bytes()
        pos = 0
        while pos < len(data):
            (length,) = struct.unpack("<Q", data[pos : pos + 8])
            event = event_pb2.Event.FromString(data[pos + 12 : pos + 12 + length])
            tags.update(v.tag for v in event.summary.value)
            pos += 12 + length + 4
    return tags
