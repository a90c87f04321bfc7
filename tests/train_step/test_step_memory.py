"""The differentiated pass of the train step keeps temporaries linear in the sequence
(gspo_jax issue 22).

The gradient of `train_step.response_logprobs` (the decoder with the splash kernel, the
TPU path, in Pallas interpret mode here; then the chunked log-softmax), with the trainer's
shapes and shardings (tools.aot's), is compiled on CPU at two response lengths 4x apart, and
XLA's temporaries are compared. XLA:CPU has no on-chip memory that absorbs a fixed amount
first (unlike XLA:TPU's VMEM, docs/tpu.md section 4), so temporaries linear in the length
plus a non-negative constant grow at most as much as the length: 1,040 / 272 = 3.8x here
(measured 3.3x). An [L, L] buffer anywhere in the pass (a dense mask, scores outside the
kernel, a quadratic residual) grows about 15x: the einsum attention ("xla"), which
materialises [H, L, L] scores, measured 9.9x on this model. The bound is the issue's target,
4.5x: the length ratio plus margin for XLA's buffer packing.
"""

import jax
import jax.numpy as jnp

from configs import default
from gspo_jax.config import specs
from gspo_jax.train_step.step import response_logprobs
from tools import aot


def _grad_temp(response_length: int) -> tuple[int, int]:
    """(XLA's temporary bytes, tokens per row) of the tiny model's differentiated pass."""
    c = default.get_config()
    c.model.num_layers, c.model.attention_impl = 1, "splash"
    c.rollout_batch_size, c.num_return_sequences_in_group = 1, 2
    c.num_mini_batches, c.micro_batch_size = 1, 2
    c.mesh.data, c.mesh.fsdp = 1, 2
    c.prompt_length, c.sampling.prompt_buckets = 16, (16,)
    c.response_length, c.eval.batch_size = response_length, 2
    c.packing = False  # the padded pass (packed rows depend on the batch)
    cfg = specs.scratch_model_config(c, vocab_size=64, eos_token_ids=(1,), pad_token_id=0)
    a = aot._abstract_run(c, cfg, jax.devices()[:2], num_processes=1)

    def loss(params, tokens_BL, mask_BL):
        logp_BT, _, _ = response_logprobs(a.step_config, params, tokens_BL, mask_BL, a.T)
        return jnp.sum(logp_BT)

    with jax.set_mesh(a.mesh):
        tokens = aot._batch_sds(a.mesh, (a.B, a.L), jnp.int32)
        compiled = jax.jit(jax.grad(loss)).lower(a.params, tokens, tokens).compile()
    return int(compiled.memory_analysis().temp_size_in_bytes), a.L


def test_differentiated_pass_temporaries_grow_linearly_with_length():
    short, L_short = _grad_temp(256)
    long, L_long = _grad_temp(1024)
    assert L_long / L_short < 4.0
    assert short > 0
    assert long / short <= 4.5, (
        f"temporaries grew {long / short:.2f}x ({short} -> {long} bytes) for "
        f"{L_long / L_short:.2f}x the tokens: something in the pass is super-linear in length"
    )
