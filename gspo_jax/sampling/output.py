"""`SampleOutput`: what `sampling.sample` returns, whichever engine ran."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class SampleOutput:
    """What `sample` returns (all rows B = N·G, the G samples of prompt n at n·G … n·G+G−1).

    tokens        int32 [B, T]  response tokens; pad_id after the end token
    mask          int32 [B, T]  1 for generated tokens up to and including the first end token
    logprobs      f32 [B, T]    log softmax(logits / τ) at each sampled token, 0 where mask is 0
                                (see `sample` for exactly which distribution)
    lengths       int32 [B]     Σ_t mask (the end token included)
    truncated     bool [B]      no end token within max_new_tokens
    prompt_tokens int32 [B, P]  the prompts as fed to the model: trimmed to the bucket, left
                                padded, repeated G times (row-aligned with `tokens`)
    prompt_mask   int32 [B, P]  their mask
    num_steps     int32 []      columns generated before the loop stopped (≤ T; < T when every
                                row ended early — the columns after it hold pad_id)
    row_steps     int32 []      decode rows computed: Σ over the token loop's steps of the rows
                                it ran (B · num_steps for the static engine); Σ lengths /
                                row_steps is the useful share of the decode
    preemptions   int32 []      sequences preempted and decoded again for want of KV pages
                                (continuous engine; 0 for the static one)
    """

    tokens: jax.Array
    mask: jax.Array
    logprobs: jax.Array
    lengths: jax.Array
    truncated: jax.Array
    prompt_tokens: jax.Array
    prompt_mask: jax.Array
    num_steps: jax.Array
    row_steps: jax.Array | None = None
    preemptions: jax.Array | None = None

    def sequences(self):
        """(tokens [B, P+T], attention_mask [B, P+T]) = concat(prompt, response): the input
        of `models.forward` / the trainer; logits at column P+t−1 predict response token t."""
        tokens = jnp.concatenate([self.prompt_tokens, self.tokens], axis=1)
        mask = jnp.concatenate([self.prompt_mask, self.mask.astype(self.prompt_mask.dtype)], 1)
        return tokens, mask


@struct.dataclass
class EngineStats:
    """What one continuous call did: loop steps, row steps (Σ over steps of the loop's
    width: the decode rows computed), sequences preempted (and decoded again).
    Useful-row efficiency = Σ lengths / row_steps."""

    steps: jax.Array
    row_steps: jax.Array
    preemptions: jax.Array
