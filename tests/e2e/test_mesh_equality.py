"""One whole RL step is the same on every mesh: sample -> rewards -> advantages -> train step.

Each layout is a real run's pieces: `setup.setup(config, workdir, devices=...)` with
`config.mesh` set, the Hugging Face fixture loaded by `loop.init_or_restore`, one rollout
from `rollouts.collect` (the real f32 sampler with the step's fixed key, a fixed reward of the
response text so advantages and gradients are non-zero, π_old recomputed, the jitted
advantage function) and `loop.train_on` on it (4 mini-batches, AdamW) once per (ratio,
aggregation) mode. Every layout is compared with the one-device run of the same config:
sampled tokens and rewards exactly, every float (sampler log-probs, advantages, the step's
metrics, π_old's among them through the ratios, the updated params) within 1e-5.

Compile budget (2 CPU cores): one Run, sampler and advantage function per layout, one train
step per (layout, mode). The modes are four (ratio, aggregation) pairs that together cover
the three ratio modes and the four aggregation modes: the ratio decides each token's loss,
the aggregation how the batch is reduced (with the whole mini-batch's denominators, the
part sharding could break), and `objectives.policy_loss` composes the two independently.
Each layout runs two of them (COVER_SPLIT), every mode on some data-sharded layout; the
one-device reference runs all that its layouts do.
`python tests/e2e/test_mesh_equality.py` runs the whole 3 x 4 grid on every mesh and prints the
table of measured differences.
"""

import dataclasses
import itertools
import os

if __name__ == "__main__":  # the table below, outside pytest (conftest.py does this there)
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gspo_jax.rewards.testing  # noqa: F401  (registers test_checksum)
from configs import default
from gspo_jax import advantages as advantages_lib
from gspo_jax import objectives, sharding
from gspo_jax.config import specs
from gspo_jax.rollout import stage as rollout
from gspo_jax.train_step import make_train_step
from gspo_jax.trainer import loop, setup

DENSE, MOE = "tests/fixtures/models/qwen3", "tests/fixtures/models/qwen3_moe"
TOL = 1e-5  # f32
RATIOS = ("seq", "token", "seq_token")
AGGS = tuple(objectives.LOSS_AGG_MODES)
GRID = tuple(itertools.product(RATIOS, AGGS))
# Every ratio mode and every aggregation mode at least once.
COVER = (
    ("seq", "seq-mean-token-mean"),
    ("token", "token-mean"),
    ("seq_token", "seq-mean-token-sum"),
    ("seq", "seq-mean-token-sum-norm"),
)
# The tests give each layout two of the four (compiles are the cost: one train step per
# layout and mode); together the layouts cover every mode, the paper's two (GSPO's sequence
# ratio with its length-normalised mean, GRPO's token ratio) on the richest mesh.
COVER_SPLIT = {
    "data 8": (COVER[2], COVER[3]),
    "data 2 x fsdp 4": (COVER[1], COVER[2]),
    "data 2 x fsdp 2 x tensor 2": (COVER[0], COVER[1]),
    "fsdp 2 x expert 2 x tensor 2": (COVER[0], COVER[1]),
}
DENSE_MESHES = {
    "data 8": {"data": 8},
    "data 2 x fsdp 4": {"data": 2, "fsdp": 4},
    "data 2 x fsdp 2 x tensor 2": {"data": 2, "fsdp": 2, "tensor": 2},
}
MOE_MESHES = {"fsdp 2 x expert 2 x tensor 2": {"fsdp": 2, "expert": 2, "tensor": 2}}
# Paper §5.1: GSPO's clip range, and GRPO's for the token ratio.
CLIP = {"seq": (3e-4, 4e-4), "seq_token": (3e-4, 4e-4), "token": (0.2, 0.27)}


def _config(data_dir, model: str, mesh: dict[str, int]):
    c = default.get_config()
    c.model.hf_path = model
    c.model.tokenizer_path = "tests/fixtures/models/tokenizer"
    c.data.data_dir = str(data_dir)
    c.rollout_batch_size, c.num_return_sequences_in_group = 8, 4  # B = 32 rows
    c.num_mini_batches = 4  # 8 rows each: one per device of an 8-way batch split
    c.prompt_length, c.response_length = 24, 8
    c.sampling.prompt_buckets = (24,)
    c.reward.spec = c.reward.accuracy = "test_checksum"
    c.reward.num_workers = 0
    # AdamW with eps far above every |gradient| is momentum SGD: each update is proportional
    # to its gradient, so the params after the step compare the gradients themselves. At the
    # default eps (1e-8) Adam divides each gradient element by its own size, and an element
    # whose gradient nearly cancels carries its relative rounding error into the update at
    # full size (measured: up to 1.5e-5 on the MoE model with lr 1e-3, 0.4% of the update).
    c.optim.learning_rate, c.optim.eps = 0.1, 1.0
    c.warm_start.steps = 0
    c.checkpoint.async_save = False
    c.log.progress_bar = c.log.plot = c.log.tensorboard = False
    for axis in ("data", "fsdp", "tensor", "expert"):
        c.mesh[axis] = mesh.get(axis, 1)
    return c


def _with_modes(config, ratio: str, agg: str):
    c = config.copy_and_resolve_references()
    c.importance_sampling, c.loss_agg_mode = ratio, agg
    c.clip_low, c.clip_high = CLIP[ratio]
    return c


def _one_step(workdir, config, devices, modes) -> dict:
    """The rollout of RL step 0 and, per (ratio, agg) mode, the step's metrics and params."""
    trainer = setup.setup(config, str(workdir), devices=devices)
    try:
        # Traced under the mesh, as `loop.run` traces them: the model pins its activation
        # layouts (partition.constrain) only with a mesh in context.
        with jax.set_mesh(trainer.mesh):
            state = loop.init_or_restore(trainer)
            prompts = next(trainer.train_iter)
            out = trainer.rollouts.collect(state, prompts)
            result = {
                "tokens": np.asarray(out.batch["tokens"]),
                "rewards": out.rewards,
                "sampler log-probs": np.asarray(out.batch["sampler_logprobs"]),
                "advantages": np.asarray(out.batch["advantages"]),
            }
            for ratio, agg in modes:
                variant = _with_modes(config, ratio, agg)
                step_config = specs.step_config(variant, trainer.model_config)
                # What setup builds for `variant` (make_train_step with the run's shardings).
                step = make_train_step(
                    step_config,
                    trainer.tx,
                    state_shardings=trainer.state_shardings.train,
                    mesh=trainer.mesh,
                )
                pieces = dataclasses.replace(trainer, step_config=step_config, train_step=step)
                # The train step donates its state: give each mode its own copy.
                fresh = state.replace(
                    train=jax.device_put(
                        jax.tree.map(jnp.copy, state.train), trainer.state_shardings.train
                    )
                )
                new, metrics = loop.train_on(pieces, fresh, out)
                assert int(new.train.step) == config.num_mini_batches
                metrics = {
                    k: float(v)
                    for k, v in jax.device_get(metrics).items()
                    if k.startswith(("policy/", "sampler/")) and np.ndim(v) == 0
                }
                result[ratio, agg] = (metrics, jax.device_get(new.train.params))
            result["params0"] = jax.device_get(state.train.params)
            result["param shardings"] = {
                len(x.sharding.device_set) for x in jax.tree.leaves(state.train.params)
            }
            return result
    finally:
        trainer.close()


def _max_diff(a, b) -> float:
    return max(
        float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
    )


def _compare(name: str, got: dict, ref: dict, modes) -> list[str]:
    """Assert `got` equals `ref`; return the table rows of measured differences."""
    np.testing.assert_array_equal(got["tokens"], ref["tokens"], err_msg=f"{name}: tokens")
    np.testing.assert_array_equal(got["rewards"], ref["rewards"], err_msg=f"{name}: rewards")
    assert np.ptp(ref["advantages"]) > 1  # non-trivial rewards: the step has a gradient
    rollout_diffs = [_max_diff(got[k], ref[k]) for k in ROLLOUT_KEYS]
    rows = []
    for ratio, agg in modes:
        (m_got, p_got), (m_ref, p_ref) = got[ratio, agg], ref[ratio, agg]
        assert m_got.keys() == m_ref.keys()
        rel = {k: abs(m_got[k] - m_ref[k]) / max(1.0, abs(m_ref[k])) for k in m_ref}
        worst = max(rel, key=rel.get)
        param_diff = _max_diff(p_got, p_ref)
        moved = _max_diff(p_ref, ref["params0"])
        cells = [f"{d:.1e}" for d in rollout_diffs]
        cells += [f"{rel[worst]:.1e} ({worst.removeprefix('policy/')})", f"{param_diff:.1e}"]
        rows.append(f"| {name} | {ratio} | {agg} | equal | {' | '.join(cells)} | {moved:.1e} |")
        assert max(*rollout_diffs, rel[worst], param_diff) <= TOL, rows[-1]
        assert moved > 100 * TOL, rows[-1]  # the step really moved the params
    return rows


ROLLOUT_KEYS = ("sampler log-probs", "advantages")
HEADER = (
    "| mesh | ratio | aggregation | tokens | sampler log-probs | advantages "
    "| metrics (rel., worst) | params | params moved |\n" + "|---" * 9 + "|"
)


def _check_layouts(tmp_path, model: str, layouts: dict, modes) -> list[str]:
    """Run the one-device step and each layout's; compare; return the table rows. `modes`:
    the (ratio, aggregation) pairs of every layout, or a dict of them per layout name."""
    devices = jax.devices()
    assert len(devices) == 8, "conftest.py gives the tests 8 fake CPU devices"
    per_layout = modes if isinstance(modes, dict) else dict.fromkeys(layouts, modes)
    everything = tuple(dict.fromkeys(m for ms in per_layout.values() for m in ms))
    data_dir = tmp_path / "data"
    ref = _one_step(tmp_path / "one", _config(data_dir, model, {}), devices[:1], everything)
    rows = []
    for name, mesh in layouts.items():
        got = _one_step(tmp_path / name, _config(data_dir, model, mesh), devices, per_layout[name])
        assert max(got["param shardings"]) > 1, f"{name}: no parameter is sharded"
        rows += _compare(name, got, ref, per_layout[name])
    return rows


@pytest.mark.parametrize("token_level", [False, True], ids=["per-response", "per-token"])
def test_advantage_function_declares_its_layout_and_matches_one_device(token_level):
    """`make_advantage_fn(spec, mesh)`: advantages over the batch axes, the running
    statistics replicated, inputs in any layout moved there; the values of one device."""
    c = default.get_config()
    c.num_return_sequences_in_group = 4
    c.reward_norm, c.whiten_advantages = "running", True
    c.add_token_level_kl, c.token_level_kl_coef = token_level, 0.1
    rng = np.random.default_rng(0)
    rewards = rng.random(32).astype(np.float32)
    valid = rng.random(32) > 0.2
    old = -rng.random((32, 6)).astype(np.float32)
    kwargs = {
        "old_logprobs": old,
        "ref_logprobs": old - 0.5 * rng.random((32, 6)).astype(np.float32),
        "mask": (np.arange(6) < rng.integers(1, 7, (32, 1))).astype(np.float32),
    }
    running = advantages_lib.init_running_moments()
    want, want_running = rollout.make_advantage_fn(specs.advantage_spec(c))(
        rewards, valid, running, **kwargs
    )
    assert np.ptp(np.asarray(want)) > 1
    for mesh in (
        sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": 1, "expert": 1}, jax.devices()[:1]),
        sharding.make_mesh({"data": 2, "fsdp": 4, "tensor": 1, "expert": 1}),
    ):
        fn = rollout.make_advantage_fn(specs.advantage_spec(c), mesh)
        # π_old replicated, as a jit that did not declare its layout may leave it: moved.
        moved = {**kwargs, "old_logprobs": jax.device_put(old, sharding.replicated(mesh))}
        got, got_running = fn(rewards, valid, running, **moved)
        assert got.sharding == sharding.batch_sharding(mesh, got.ndim)
        for leaf in got_running:
            assert leaf.sharding == sharding.replicated(mesh)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(np.asarray(got_running), np.asarray(want_running), rtol=1e-6)
    with pytest.raises(ValueError, match="12 rewards do not split over the 8 data-parallel"):
        fn(rewards[:12], valid[:12], running, **{k: v[:12] for k, v in kwargs.items()})


@pytest.mark.slow
def test_dense_rl_step_is_the_same_on_every_mesh(tmp_path):
    modes = {name: COVER_SPLIT[name] for name in DENSE_MESHES}
    print("\n".join([HEADER, *_check_layouts(tmp_path, DENSE, DENSE_MESHES, modes)]))


@pytest.mark.slow
def test_moe_rl_step_is_the_same_with_an_expert_axis(tmp_path):
    modes = {name: COVER_SPLIT[name] for name in MOE_MESHES}
    print("\n".join([HEADER, *_check_layouts(tmp_path, MOE, MOE_MESHES, modes)]))


if __name__ == "__main__":
    # The whole 3 x 4 grid of (ratio, aggregation) on every mesh (about 3x the test's time).
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        rows = _check_layouts(Path(tmp) / "dense", DENSE, DENSE_MESHES, GRID)
        rows += _check_layouts(Path(tmp) / "moe", MOE, MOE_MESHES, GRID)
    print("\n".join([HEADER, *rows]))
