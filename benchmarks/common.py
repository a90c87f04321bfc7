"""What every benchmark shares: one timer, one matmul-rate reference, one FLOP model.

Every speed figure a benchmark prints is a ratio to something measured in the same run
(usually `matmul_rate`), because the machines are shared and absolute times drift.

The FLOP model (model FLOPs: what the computation needs, not what an implementation
spends; rematerialisation and the log-prob backward's logit recompute are NOT counted):

  per token and layer stack, forward   2 · matmul_params(cfg)        (active experts only)
  per token that gets logits, forward  2 · D · V                     (unembed_flops)
  attention, forward                   4 · layers · H · C per (query, key) pair
                                       causal full-sequence pass over L: L/2 keys on average
                                       decode step: the keys in the cache
  backward                             2 x forward, so forward + backward = 3 x forward

Run as scripts (`python benchmarks/<name>.py`): this module is imported as `common`.
"""

from __future__ import annotations

import collections
import glob
import os
import re
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp

from gspo_jax import models

# ------------------------------------------------------------------------------------ timing


def seconds(fn, *args) -> float:
    """Wall seconds of one call of fn(*args), waiting for its outputs."""
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - t0


def median_seconds(fn, *args, reps: int = 3, warmup: int = 1) -> float:
    """Median wall seconds of fn(*args) over `reps` calls after `warmup` (compile) calls."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    return statistics.median(seconds(fn, *args) for _ in range(reps))


def matmul_fn(n: int | None = None, dtype: str = "float32"):
    """(compiled n x n matmul, its arguments, its FLOPs): the reference of every ratio.

    n defaults to 2048 on a CPU and 8192 on an accelerator; bf16 inputs accumulate in f32.
    """
    n = n or (2048 if jax.default_backend() == "cpu" else 8192)
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32).astype(dtype)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.float32).astype(dtype)
    mm = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32))
    return mm.lower(a, b).compile(), (a, b), 2 * n**3


def matmul_rate(n: int | None = None, dtype: str = "float32", reps: int = 5) -> float:
    """This machine's measured matmul FLOP/s now (median of `reps` after a warm-up)."""
    mm, args, flops = matmul_fn(n, dtype)
    return flops / median_seconds(mm, *args, reps=reps)


# -------------------------------------------------------------------------------- FLOP model


def matmul_params(cfg: models.ModelConfig) -> int:
    """Weights one token multiplies in the layer stack (top-k experts of an MoE layer, the
    router included); the embedding lookup and the unembedding are not counted here."""
    d, h, k, c = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    total = 0
    for layer in range(cfg.num_layers):
        total += d * h * c * 2 + d * k * c * 2  # q, o; k, v
        if cfg.is_moe_layer(layer):
            total += (
                d * cfg.num_experts + 3 * d * cfg.moe_intermediate_size * cfg.num_experts_per_tok
            )
        else:
            total += 3 * d * cfg.intermediate_size
    return total


def unembed_flops(cfg: models.ModelConfig) -> float:
    """Forward FLOPs of one token's logits."""
    return 2.0 * cfg.hidden_size * cfg.vocab_size


def attention_flops(cfg: models.ModelConfig, keys: float) -> float:
    """Forward FLOPs of one query attending to `keys` keys (q·k and p·v, every layer)."""
    return 4.0 * cfg.num_layers * cfg.num_heads * cfg.head_dim * keys


def forward_flops(cfg: models.ModelConfig, batch: int, length: int, logit_tokens: int) -> float:
    """Forward FLOPs of a causal full-sequence pass over `batch` rows of `length` tokens of
    which `logit_tokens` per row get logits."""
    per_row = length * (2.0 * matmul_params(cfg) + attention_flops(cfg, length / 2))
    return batch * (per_row + logit_tokens * unembed_flops(cfg))


def train_flops(cfg: models.ModelConfig, batch: int, prompt_len: int, response_len: int):
    """Forward + backward FLOPs of one pass over `batch` prompt+response rows (logits on the
    response tokens only, as the train step computes them)."""
    return 3.0 * forward_flops(cfg, batch, prompt_len + response_len, response_len)


def train_flops_shared_prompt(
    cfg: models.ModelConfig, prompts: int, group: int, prompt_len: int, response_len: int
):
    """`train_flops` of N prompts x G responses when each prompt goes through the model once
    (`shared_prompt`): N·P prompt tokens (causal among themselves) and N·G·T response
    tokens, each response attending to its prompt and to itself (causal)."""
    n, g, p, t = prompts, group, prompt_len, response_len
    per_token = 2.0 * matmul_params(cfg)
    prompt = n * p * (per_token + attention_flops(cfg, p / 2))
    response = n * g * t * (per_token + attention_flops(cfg, p + t / 2) + unembed_flops(cfg))
    return 3.0 * (prompt + response)


def decode_step_flops(cfg: models.ModelConfig, batch: int, keys: float) -> float:
    """FLOPs of one decode step: `batch` new tokens, each attending to `keys` cached keys."""
    return batch * (2.0 * matmul_params(cfg) + unembed_flops(cfg) + attention_flops(cfg, keys))


# --------------------------------------------------------------------------------- profiling


def hlo_op_sources(compiled_text: str) -> dict[str, str]:
    """XLA op name -> the jax operation it came from (the HLO's op_name metadata), from a
    compiled function's `.as_text()`, with the jit / transpose wrappers shortened."""
    names = {}
    for line in compiled_text.splitlines():
        match = re.match(r'\s+(?:ROOT )?%?(\S+) = .*?op_name="([^"]+)"', line)
        if match:
            op = match.group(2).split("while/body/")[-1]  # a loop's ops by their own name
            op = re.sub(r"jit\((\w+)\)/", "", op)
            names[match.group(1)] = re.sub(r"\w+\.<locals>\.", "", op)
    return names


def profile_ops(fn, *args, compiled_text: str = "", trace_dir: str | None = None):
    """(Counter op -> ns, trace directory) of one call of fn(*args) under jax.profiler.

    XLA:CPU's per-op events (thunks on the XLA Eigen threads) are summed by op, and named
    by the jax operation they came from when `compiled_text` (the compiled HLO of fn) is
    given. The trace stays in `trace_dir` (TensorBoard / Perfetto can open it).
    """
    names = hlo_op_sources(compiled_text)
    directory = trace_dir or tempfile.mkdtemp(prefix="trace_")
    with jax.profiler.trace(directory):
        jax.block_until_ready(fn(*args))
    path = max(glob.glob(os.path.join(directory, "**", "*.xplane.pb"), recursive=True))
    data = jax.profiler.ProfileData.from_file(path)
    total = collections.Counter()
    for plane in data.planes:
        for line in plane.lines:
            if not line.name.startswith("tf_XLA"):
                continue
            for ev in line.events:
                # executor bookkeeping and thread-pool waits are not op time
                if "ThunkExecutor" not in ev.name and not ev.name.endswith("::Await"):
                    total[names.get(ev.name, ev.name)] += ev.duration_ns
    return total, directory


# Op categories of a train-step profile, by the jax operation an XLA op came from (first
# match wins): einsum specs name the attention and the log-prob (unembedding) products.
OP_CATEGORIES = (
    ("attention einsums", ("rc,", "rs,", "rp,", "rw,", "ls,")),
    ("unembedding / log-probs", ("d,dv", "v,dv", "d,btv", "logprob")),
    ("weight matmuls", ("dot_general",)),
    ("layer-scan bookkeeping", ("dynamic_update_slice", "dynamic_slice", "broadcast_in_dim")),
)


def op_categories(total: collections.Counter) -> dict[str, float]:
    """Share of a `profile_ops` count in each of OP_CATEGORIES (the rest: "elementwise and
    other": norms, RoPE, softmax, SiLU, the optimizer, layout copies)."""
    whole = sum(total.values()) or 1
    shares = {name: 0.0 for name, _ in OP_CATEGORIES}
    shares["elementwise and other"] = 0.0
    for op, ns in total.items():
        name = next(
            (n for n, keys in OP_CATEGORIES if any(k in op for k in keys)),
            "elementwise and other",
        )
        shares[name] += ns / whole
    return shares


def print_top_ops(total: collections.Counter, top: int = 20, title: str = "") -> None:
    """The `top` ops of a `profile_ops` count, in ms and as a share of the sum."""
    whole = sum(total.values()) or 1
    print(f"\n{title} ({whole / 1e6:.1f} ms of op time in all, summed over threads)")
    for name, ns in total.most_common(top):
        print(f"  {ns / 1e6:8.2f} ms  {100 * ns / whole:5.1f}%  {name[:150]}")
    print("by category:")
    for name, share in op_categories(total).items():
        print(f"  {100 * share:5.1f}%  {name}")


# --------------------------------------------------------------------------------- baselines


def python_loop_sampler(cfg: models.ModelConfig, params, tokens_NP, mask_NP, g: int, t: int):
    """The baseline `sampling.sample` is measured against: a per-token Python loop over the
    model's own cached decode step (one prefill per prompt, one dispatch per token).

    Returns a function that samples `g` responses of `t` tokens per prompt and returns the
    tokens [N·G, T] (ready).
    """
    num_rows = tokens_NP.shape[0] * g

    @jax.jit
    def draw(logits, key, s):
        return jax.random.categorical(jax.random.fold_in(key, s), logits).astype(jnp.int32)

    def run():
        prompt, logits, _ = models.prefill_shared(cfg, params, tokens_NP, mask_NP)
        response = models.init_response_cache(cfg, num_rows, t)
        logits = jnp.repeat(logits, g, axis=0)
        key, out = jax.random.key(2), []
        for s in range(t):
            token = draw(logits, key, s)
            out.append(token)
            if s + 1 < t:  # response token s goes into response slot s
                logits, response, _ = models.decode_step_shared(
                    cfg, params, prompt, response, token, jnp.int32(s)
                )
        return jax.block_until_ready(jnp.stack(out, axis=1))

    return run
