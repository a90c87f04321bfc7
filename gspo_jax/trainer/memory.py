"""Memory that sampling needs, checked at start-up, and out-of-memory errors that name the
config field behind them.

A rollout samples `rollout_batch_size x num_return_sequences_in_group` responses at once, the
held-out evaluation `eval.batch_size` greedy responses and, with `eval.pass_k` = k,
`eval.batch_size x k` sampled ones. Each row holds a key/value cache of
`prompt_length + response_length` positions in every layer:

  bytes(rows) >= rows x length x layers x 2 (key, value) x kv_heads x head_dim x 1 byte

(1 byte: an int8 cache, the smallest) split over every device of the mesh, a lower bound. `check_sampling_fits` compares the largest of these with
one device's memory (the host's RAM on a CPU) before anything is compiled: a huge
`eval.pass_k` used to fail minutes later, after the model load and the first RL steps'
compile, as XLA's "Error dispatching computation" or "RESOURCE_EXHAUSTED", naming no field.
`name_the_field` rewrites such an error raised later (an estimate is a lower bound: logits,
activations and the params need room too) into one naming the fields.
"""

from __future__ import annotations

import contextlib
import os

from gspo_jax.config import specs
from gspo_jax.config.validate import ConfigError

# Messages of XLA's out-of-memory errors (GPU, TPU, CPU allocators).
_OOM_MARKERS = ("RESOURCE_EXHAUSTED", "Out of memory", "out of memory", "OOM when allocating")
GIB = 2**30


def kv_cache_bytes(model_config, rows: int, length: int) -> int:
    """A lower bound on the bytes of the key/value cache of `rows` sequences of `length`
    positions: one byte per element (an int8 cache; bfloat16 is twice that, float32 four
    times), so the start-up check never refuses a run that could fit. A hybrid model's
    Gated DeltaNet layers keep no keys or values (a fixed-size state per row instead): its
    full-attention layers only."""
    c = model_config
    layers = c.num_layers - c.num_linear_layers
    return rows * length * layers * 2 * c.num_kv_heads * c.head_dim


def device_memory_bytes(device) -> int | None:
    """One device's memory: the allocator's limit on a GPU/TPU, the host's RAM on a CPU."""
    stats = None
    with contextlib.suppress(Exception):  # not every backend reports memory stats
        stats = device.memory_stats()
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    if getattr(device, "platform", "") == "cpu":
        with contextlib.suppress(ValueError, OSError, AttributeError):
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return None


def sampling_loads(config) -> list[tuple[str, int, str]]:
    """(the fields that set it, rows sampled at once, description) of each sampling call."""
    c = config
    rollout = c.rollout_batch_size * c.num_return_sequences_in_group
    loads = [
        (
            "rollout_batch_size x num_return_sequences_in_group",
            rollout,
            f"a rollout of {c.rollout_batch_size} x {c.num_return_sequences_in_group} responses",
        )
    ]
    per_call = min(c.eval.batch_size, c.eval.num_prompts)
    loads.append(("eval.batch_size", per_call, f"{per_call} greedy held-out responses"))
    k = specs.pass_k(c)
    if k:
        name = specs.pass_k_field(c)
        loads.append((name, per_call * k, f"{per_call} held-out prompts x {name}={k} samples"))
    return loads


def check_sampling_fits(config, model_config, devices) -> None:
    """ConfigError naming the field when one sampling call's key/value cache alone exceeds
    a device's memory (module docstring); nothing when the memory is unknown."""
    available = device_memory_bytes(devices[0]) if devices else None
    if not available:
        return
    length = config.prompt_length + config.response_length
    for fields, rows, what in sampling_loads(config):
        need = kv_cache_bytes(model_config, rows, length) // len(devices)
        if need > available:
            raise ConfigError(
                f"config.{fields.split(' x ')[0]}: {what} of {length} tokens need a key/value "
                f"cache of at least {need / GIB:.1f} GiB per device, more than the "
                f"{available / GIB:.1f} GiB of one {devices[0].platform} device. Lower "
                f"{fields.replace(' x ', ' or ')} (or prompt_length + response_length)"
            )


def is_out_of_memory(error: BaseException) -> bool:
    text = f"{type(error).__name__}: {error}"
    return isinstance(error, MemoryError) or any(m in text for m in _OOM_MARKERS)


@contextlib.contextmanager
def name_the_field(what: str, fields: str):
    """Re-raises an out-of-memory error inside the block as a MemoryError naming `what` and
    the config `fields` that size it (the original is its cause)."""
    try:
        yield
    except Exception as e:
        if not is_out_of_memory(e):
            raise
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise MemoryError(
            f"{what} ran out of memory ({first}): lower {fields}, or use more devices"
        ) from e
