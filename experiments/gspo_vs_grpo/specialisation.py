"""How specialised an MoE's experts are: the measures the results report for the MoE test
bed (`arms.MoETestBed`), before and after the supervised steps that specialise it.

- `expert_spread`: per MoE layer, each expert's distance from the experts' mean,
  ||W_e − mean_e W|| / ||mean_e W|| over its gate, up and down weights together, averaged
  over experts and layers. Noisy copies sit at about the upcycling noise (0.01 or 0.1);
  experts trained apart move further.
- `load_entropy`: per MoE layer, the entropy of the share of (token, top-k slot)
  assignments each expert receives, over log E (1: every expert equally used; near 0:
  the router collapsed onto a few), averaged over layers; `max_load` the largest share
  times E (1: uniform), the worst layer's.

Shapes: M MoE layers, E experts, B rows, L tokens, X experts per token (top-k).
"""

from __future__ import annotations

import numpy as np


def expert_spread(params) -> float:
    """Mean relative distance of each expert's weights from the experts' mean (see above)."""
    moe = params["layers"]["moe"]
    w = [np.asarray(moe[k], np.float64) for k in ("gate_proj", "up_proj", "down_proj")]
    # [M, E, ...] each: flatten every expert's three matrices into one vector
    flat_MEP = np.concatenate([x.reshape(x.shape[0], x.shape[1], -1) for x in w], axis=-1)
    mean_MP = flat_MEP.mean(axis=1)
    dist_ME = np.linalg.norm(flat_MEP - mean_MP[:, None], axis=-1)
    return float(np.mean(dist_ME / np.linalg.norm(mean_MP, axis=-1)[:, None]))


def routing_measures(routing_MBLX, mask_BL, num_experts: int) -> dict:
    """load_entropy and max_load (see above) of the chosen experts [M, B, L, X] on the
    valid tokens [B, L]."""
    routing_MBLX = np.asarray(routing_MBLX)
    M, E = routing_MBLX.shape[0], num_experts
    valid_BL = np.asarray(mask_BL) > 0
    entropies, loads = [], []
    for m in range(M):
        chosen = routing_MBLX[m][valid_BL].reshape(-1)
        share_E = np.bincount(chosen, minlength=E) / max(chosen.size, 1)
        nz = share_E[share_E > 0]
        entropies.append(float(-(nz * np.log(nz)).sum() / np.log(E)))
        loads.append(float(share_E.max() * E))
    return {
        "load_entropy": float(np.mean(entropies)),
        "max_load": float(np.max(loads)),
    }


def measure(model_config, params, batches) -> dict:
    """expert_spread and the routing measures over `batches` (dicts with tokens and
    attention_mask [B, L]), their routing concatenated over rows."""
    import jax
    import jax.numpy as jnp

    from gspo_jax import models

    routes, masks = [], []
    for batch in batches:
        tokens, mask = jnp.asarray(batch["tokens"]), jnp.asarray(batch["attention_mask"])
        _, routing_MBLX = models.hidden_states(model_config, params, tokens, mask)
        routes.append(np.asarray(routing_MBLX))
        masks.append(np.asarray(mask))
    out = routing_measures(
        np.concatenate(routes, axis=1), np.concatenate(masks), model_config.num_experts
    )
    out["expert_spread"] = expert_spread(jax.device_get(params))
    return out
