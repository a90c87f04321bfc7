"""The continuous engine's static plan (continuous.py runs it): how many decode slots
(`default_num_slots`, from the KV budget and the platform's decode cost), how many pages
(`plan`: the budget of tokens in flight), how the loop narrows once the queue is empty
(`drain_widths`) (replica_axes, in replicas.py, splits it per chip group). Plain Python on static sizes: nothing here is traced.
"""

from __future__ import annotations

import dataclasses

from gspo_jax.models.attention import target_platform


@dataclasses.dataclass(frozen=True)
class PagePlan:
    """Static sizes of one engine call (hashable: a jit static argument).

    num_slots   S decode rows
    page_size   tokens per page
    num_pages   R response pages (the budget of tokens in flight / page_size)
    prompt_pages pages per prompt row, ⌈P / page_size⌉
    seq_pages   most own pages one sequence can need: ⌈T / page_size⌉ + 1
    """

    num_slots: int
    page_size: int
    num_pages: int
    prompt_pages: int
    seq_pages: int

    @property
    def table_width(self) -> int:
        return self.prompt_pages + self.seq_pages


# Decode rows below which a step costs about the same per platform (`default_num_slots`):
# a dense decode step reads every weight once and multiplies it by every row (2 FLOPs per
# weight and row), so it is bound by the weight read until rows ≈ peak FLOP/s × bytes per
# weight / (2 × memory bandwidth): bf16 v5e 197e12 × 2 / (2 × 819e9) ≈ 240, v5p ≈ 166, v6e
# ≈ 560, H100 ≈ 295; f32 on a 2-core AVX-512 CPU ≈ 180e9 × 4 / (2 × ~20e9) ≈ 18 (measured:
# 16 of 64 slots on benchmarks/sampler_longtail.py's long tail, docs/benchmarks.md).
FLAT_ROWS = {"tpu": 256, "gpu": 256, "cuda": 256, "rocm": 256, "cpu": 16}
QUEUE_DEPTH = 4  # sequences per slot, on average, that the default keeps queued
SLOT_MULTIPLE = 8  # the default's slots are a multiple of this (replicas divide them)


def default_num_slots(
    num_sequences: int,
    seq_pages: int,
    page_size: int,
    kv_budget_tokens=None,
    platform: str | None = None,
    replicas: int = 1,
) -> int:
    """Decode slots when `num_slots` is None:

        S = min(B, S_kv, max(R · FLAT_ROWS[platform], ⌈B / QUEUE_DEPTH⌉ rounded up to 8))

    R: the engine replicas the slots are split over (`replicas.replica_count`): FLAT_ROWS
    is what one replica's step holds at the cost of fewer rows, so R replicas hold R times
    that (before, 64 replicas of Qwen3-8B on v5p-128 got 4 slots each for 8 sequences: two
    waves of weight reads where one does).

    S_kv: the slots whose full-length sequences fit `kv_budget_tokens` (⌊pages /
    seq_pages⌋; B without a budget), so no row waits for a page. Below FLAT_ROWS rows a
    step costs about what it costs with fewer (the weight read dominates), so fewer slots
    save nothing and only lengthen the run: with B ≤ FLAT_ROWS every sequence gets a slot
    (the run then takes as many steps as the longest response, the least possible). Above
    it a step costs per row, so slots should stay full: B / QUEUE_DEPTH slots keep ~3/4 of
    the sequences queued at the start and the queue non-empty for most of the decode (the
    drain, `drain_widths`, narrows the loop once it is empty). On a TPU (256) this is one
    slot per sequence up to 256 sequences, then B/4; on CPU (16), B/4 from 64 sequences."""
    B = int(num_sequences)
    platform = platform or target_platform()
    fit = B if kv_budget_tokens is None else int(kv_budget_tokens) // page_size // seq_pages
    queued = -(-B // QUEUE_DEPTH)
    queued = -(-queued // SLOT_MULTIPLE) * SLOT_MULTIPLE
    flat = int(replicas) * FLAT_ROWS.get(platform, FLAT_ROWS["cpu"])
    return max(1, min(B, fit, max(flat, queued)))


def plan(
    num_sequences: int,
    prompt_width: int,
    max_new_tokens: int,
    *,
    num_slots=None,
    page_size: int = 16,
    kv_budget_tokens=None,
    platform: str | None = None,
    replicas: int = 1,
) -> PagePlan:
    """The page plan, checked (ValueError naming the option): num_slots None =
    `default_num_slots` for `platform` (default: the one compiled for), else capped at the
    sequence count; kv_budget_tokens None = every slot at full length (no row ever waits),
    else ⌊budget / page_size⌋ pages, at least one full-length sequence's."""
    for name, value in (("num_slots", num_slots), ("kv_budget_tokens", kv_budget_tokens)):
        if value is not None and (isinstance(value, bool) or int(value) != value or value < 1):
            raise ValueError(f"{name} must be None or an int >= 1, got {value!r}")
    if isinstance(page_size, bool) or int(page_size) != page_size or page_size < 1:
        raise ValueError(f"page_size must be an int >= 1, got {page_size!r}")
    seq_pages = -(-max_new_tokens // page_size) + 1
    if num_slots is None:
        num_slots = default_num_slots(
            num_sequences, seq_pages, page_size, kv_budget_tokens, platform, replicas
        )
    S = min(int(num_slots), num_sequences)
    if kv_budget_tokens is None:
        num_pages = S * seq_pages
    else:
        num_pages = int(kv_budget_tokens) // page_size
        if num_pages < seq_pages:
            raise ValueError(
                f"kv_budget_tokens={kv_budget_tokens} holds {num_pages} pages of page_size="
                f"{page_size}; one sequence of max_new_tokens={max_new_tokens} needs up to "
                f"{seq_pages} pages ({seq_pages * page_size} tokens): raise the budget"
            )
    return PagePlan(S, int(page_size), num_pages, -(-prompt_width // page_size), seq_pages)


DRAIN_MIN_WIDTH = 32  # the default drain's narrowest loop (rows)
DEFAULT_DRAIN_LEVELS = 2


def drain_widths(num_slots: int, drain_levels: int | None) -> tuple[int, ...]:
    """Loop widths: num_slots, then halved `drain_levels` times (while ≥ 1); None: up to
    DEFAULT_DRAIN_LEVELS times while the half is ≥ DRAIN_MIN_WIDTH rows."""
    floor = 1 if drain_levels is not None else DRAIN_MIN_WIDTH
    levels = DEFAULT_DRAIN_LEVELS if drain_levels is None else drain_levels
    widths = [num_slots]
    for _ in range(levels):
        if widths[-1] // 2 < floor:
            break
        widths.append(widths[-1] // 2)
    return tuple(widths)
