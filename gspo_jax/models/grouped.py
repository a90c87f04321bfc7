"""The MoE experts' grouped matmul (`layers.MoE`), with a TPU weight gradient of its own.

    grouped_matmul(x_AD, w_EDF, sizes_E, out_dtype)   rows sorted by expert, each row times
                                                      its expert's matrix: [A, F]

Forward and input gradient are `jax.lax.ragged_dot` and its own transpose. The weight
gradient, dw_e = Σ_{rows a of group e} x_aᵀ dy_a, is a ragged *contraction*: XLA:TPU (the
libtpu of jax 0.10.2) lowers `ragged_dot`'s transpose for it as one dense matmul over every
expert with the other experts' rows masked, E / top-k times the work (Qwen3.5-35B-A3B: 256
experts, top 8: 32x; its train step executed 20x its model FLOPs, docs/tpu.md section 10).
On TPU it runs megablox's `tgmm` instead (a Pallas kernel shipped with jax: each row visited
once); elsewhere `ragged_dot`'s own transpose (`jax.lax.platform_dependent` picks at
lowering, so an ahead-of-time compile for TPU on a CPU machine takes the TPU branch).
Shapes: A sorted rows (tokens x top-k), D input width, F output width, E experts.
"""

from __future__ import annotations

import functools
import importlib

import jax
import jax.numpy as jnp

# tgmm tiles the rows in blocks of this many; rows not a multiple of it (never in the
# passes' shapes: tokens x top-k per device) take ragged_dot's transpose.
_ROW_TILE = 128


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def grouped_matmul(x_AD, w_EDF, sizes_E, out_dtype=None):
    """`jax.lax.ragged_dot(x_AD, w_EDF, sizes_E, preferred_element_type=out_dtype)`; its
    weight gradient by `weight_grad` (megablox's tgmm on TPU)."""
    return jax.lax.ragged_dot(x_AD, w_EDF, sizes_E, preferred_element_type=out_dtype)


def _fwd(x_AD, w_EDF, sizes_E, out_dtype):
    return grouped_matmul(x_AD, w_EDF, sizes_E, out_dtype), (x_AD, w_EDF, sizes_E)


def _bwd(out_dtype, residuals, dy_AF):
    x_AD, w_EDF, sizes_E = residuals

    def product(x, w):
        return jax.lax.ragged_dot(x, w, sizes_E, preferred_element_type=out_dtype)

    dx_AD = jax.vjp(lambda x: product(x, w_EDF), x_AD)[1](dy_AF)[0]
    return dx_AD, weight_grad(x_AD, dy_AF, sizes_E, w_EDF), None


grouped_matmul.defvjp(_fwd, _bwd)


def weight_grad(x_AD, dy_AF, sizes_E, w_EDF, *, interpret: bool = False):
    """dw [E, D, F] (w_EDF's dtype): per group e, x_aᵀ dy_a summed over its rows a. On TPU
    (or with `interpret`, the kernel's interpreter: tests) megablox's tgmm, bf16 operands in
    the compute dtype and float32 accumulation; elsewhere ragged_dot's own transpose."""

    def reference(x, dy):
        def product(w):
            return jax.lax.ragged_dot(x, w, sizes_E, preferred_element_type=dy.dtype)

        return jax.vjp(product, w_EDF)[1](dy)[0]

    if x_AD.shape[0] % _ROW_TILE:
        return reference(x_AD, dy_AF)

    def tgmm(x, dy):
        # the module (the package's `gmm` attribute is the custom_vjp function)
        megablox = importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm")
        out = megablox.tgmm(
            x.T,
            dy.astype(x.dtype),
            sizes_E,
            preferred_element_type=jnp.float32,
            tiling=(_ROW_TILE, 128, 128),
            interpret=interpret,
        )
        return out.astype(w_EDF.dtype)

    if interpret:
        return tgmm(x_AD, dy_AF)
    return jax.lax.platform_dependent(x_AD, dy_AF, tpu=tgmm, default=reference)
