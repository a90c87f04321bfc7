"""Continuous batching over a paged KV cache: the default engine of `sample`.

A fixed number S of decode slots works through a queue of the N·G sequences (sequence b
continues prompt b // G). One `lax.while_loop` step decodes one token for every running
slot; a slot whose sequence ends (end token or max_new_tokens) frees its pages and takes the
next sequence from the queue in the same step, so no slot waits for the longest response.

  jit 1  `prefill_pages`: one prefill per prompt (`models.prefill_shared`, shared by its G
         responses), its keys/values written into pages (`models.prompt_pages`), and the
         prompts' last-position logits [Q, V]
  jit 2  `engine_loop`: the while_loop; a sequence needs no prefill of its own — its slot draws
         its first token from its prompt's logits, and points its page table at the
         prompt's pages (a prompt's partly filled last page is copied into a page of the
         slot's own, since the slot writes after it); with int8 pages each step reads a
         prompt's pages once for all its slots (`shared_prefix`, `models.SharedPrefix`)

On a mesh (the RL loop traces under `jax.set_mesh`) the engine runs one replica per
data-parallel chip group (`replica_axes`: the rollout layout's row axes), each in a
`shard_map` with its own prompts, slots, pages and queue, the model split over the other
axes inside it (`sampling.layout` and docs/tpu.md, "The rollout layout"). Sequence b is
still drawn with its global index, so the replica split changes no token.

Drain: once the queue is empty, the slots still running are fewer and fewer. When at most
half of them run, they move (`_compact`: a gather of the per-slot arrays; their pages stay
where they are) to a loop of half the width, `drain_levels` times, so the long tail of a
rollout is not decoded S rows at a time. At lognormal(mean 2048, cap 8192) lengths two
levels lift the useful share of computed rows from ~0.71-0.74 to ~0.84-0.93
(benchmarks/sampler_longtail.py --simulate). The default (None) halves at most twice and
never below DRAIN_MIN_WIDTH rows: a decode step of fewer rows costs about as much (the
weights are read either way), and each level is one more compiled copy of the decode
step (on CPU ~4 s of compilation for a small model), so small batches get none.

Slots: `num_slots` None picks `default_num_slots` (the slots a KV budget holds at full
length, at least the rows a decode step costs about the same for on the platform, at most
about a quarter of the sequences once that is more: a queue behind every slot).

Memory is budgeted in tokens in flight: a pool of `num_pages` response pages of
`page_size` tokens (`kv_budget_tokens` / page_size; default: every slot at full length)
next to the prompts' pages. A page is taken from the free list when a row crosses a page
boundary and returned when the row ends. When the free list is empty:

  - a row that needs a page waits (it skips the step; its state is unchanged);
    the oldest rows (admission order) get pages first;
  - while a row waits, no new sequence is admitted;
  - if every running row waits, the youngest one holding pages is preempted: its pages are
    freed and its sequence goes back to the queue, to be decoded again from its first
    token. Tokens are drawn with per-sequence keys (`draw.row_keys`), so the rerun produces
    the same tokens and log-probs: preemption costs time, never changes a result.

`plan` rejects, before anything compiles, a budget that cannot hold one full-length
sequence (that row could never finish). Nothing is ever truncated silently.

Hybrid models (Qwen3.5): pages for the full-attention layers only; each Gated DeltaNet
layer's conv window and recurrent state live per slot, reset from the prompt's prefill
state when the slot takes a sequence (slot_states.py).

Results are written to [B, T] by sequence index, so the output is the static sampler's:
the same tokens for the same rng (its draws use the same keys), log-probs equal to float
rounding (tests/sampling/test_sampling_continuous.py). With int8 KV pages (`kv_dtype="int8"`, the
static engine has none) a rounding difference between shapes (another slot count, engine
replicas) can move a key or value across a quantisation boundary, a whole int8 step: the
same tokens up to a draw that this flips (1 of 16 sequences in tests/sampling/test_rollout_layout.py).

Shape letters: B = N·G sequences, Q prompt rows (N shared, B not), S slots, T
max_new_tokens, M page-table width, R response pages, V vocab.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import struct

from gspo_jax import models, sharding
from gspo_jax.models import partition
from gspo_jax.sampling import replicas as replicas_lib
from gspo_jax.sampling import slot_states
from gspo_jax.sampling.draw import next_token, row_keys
from gspo_jax.sampling.layout import traced_under_layout
from gspo_jax.sampling.output import EngineStats
from gspo_jax.sampling.pages import (  # noqa: F401 (continuous.* names)
    DEFAULT_DRAIN_LEVELS,
    DRAIN_MIN_WIDTH,
    FLAT_ROWS,
    PagePlan,
    default_num_slots,
    drain_widths,
    plan,
)
from gspo_jax.sampling.replicas import replica_axes

F32 = jnp.float32
TRASH = 0  # page 0: where rows that write nothing write; never read as context


@struct.dataclass
class EngineState:
    """The while_loop's carry. kv: the page pools (a hybrid model: the pair (pools, per-slot
    Gated DeltaNet states), slot_states.py). Per slot [S]: seq (−1 idle), t (tokens drawn), last (token
    to feed next), plen (its prompt's length), stamp (admission order), table [S, M] (its
    pages), npages (table entries in use), first_own (first entry it owns), copy_src /
    copy_dst (a page copy owed by the slot's admission, made at the top of the next step:
    TRASH when none). Free list:
    free [R] (page ids, the first free_top valid). Queue: next_seq, requeue [B] (preempted
    sequences, the first requeue_len valid). Outputs by sequence: tokens, logprobs [B, T],
    length, ended [B]. Counters: steps, row_steps (Σ slots over steps), preemptions."""

    kv: tuple
    seq: jax.Array
    t: jax.Array
    last: jax.Array
    plen: jax.Array
    stamp: jax.Array
    table: jax.Array
    npages: jax.Array
    first_own: jax.Array
    copy_src: jax.Array
    copy_dst: jax.Array
    free: jax.Array
    free_top: jax.Array
    next_seq: jax.Array
    requeue: jax.Array
    requeue_len: jax.Array
    counter: jax.Array
    tokens: jax.Array
    logprobs: jax.Array
    length: jax.Array
    ended: jax.Array
    steps: jax.Array
    row_steps: jax.Array
    preemptions: jax.Array


@functools.partial(
    jax.jit,
    static_argnames=(
        "model_config",
        "num_samples",
        "share_prefix",
        "page_size",
        "layout",
        "kv_dtype",
    ),
)
@traced_under_layout
def prefill_pages(
    model_config,
    params,
    tokens_NP,
    mask_NP,
    *,
    num_samples,
    share_prefix,
    page_size,
    layout="trainer",
    kv_dtype="auto",
):
    """(prompt pages per layer, prompt lengths [Q], last-position logits [Q, V], the prompts
    repeated G times [B, P] and their mask). `layout`: the rules it is traced under;
    `kv_dtype`: the pages' storage (`models.KV_DTYPES`; int8 pages are quantised from the
    prefill's compute-dtype keys and values)."""
    G = num_samples
    if layout == "tensor":
        params = models.for_decoding(model_config, params)  # a no-op on rollout_params
    tokens_BP = jnp.repeat(tokens_NP, G, axis=0)
    mask_BP = jnp.repeat(mask_NP, G, axis=0)
    tokens_QP, mask_QP = (tokens_NP, mask_NP) if share_prefix else (tokens_BP, mask_BP)
    prompt, logits_QV, _ = models.prefill_shared(model_config, params, tokens_QP, mask_QP)
    pages = models.prompt_pages(prompt, page_size)
    pages = tuple(_constrain_pool(models.to_kv_dtype(x, kv_dtype)) for x in pages)
    if model_config.is_hybrid:  # the DeltaNet layers' states after each prompt (slot_states)
        pages = (pages, prompt.linear)
    return pages, prompt.length, logits_QV, tokens_BP, mask_BP.astype(jnp.int32)


def _constrain_pool(pool):
    """A page pool [pages, page_size, 2K, C] split over the kv heads as the rules in force
    split "kv_heads" (a chip keeps both keys and values of its heads); pages whole. Only
    where rows are whole (a replica of the engine, the tensor layout's prefill): otherwise
    the pools keep the layout GSPMD gives them. An int8 pool (`models.Int8Pages`, head
    major: q [pages, 2K, page_size, C], scales [pages, 2K, page_size]) on its axis 1."""
    mesh = partition.context_mesh()
    if mesh is None or not partition.rows_whole():
        return pool
    heads = partition.spec(mesh, ("kv_heads",), (pool.shape[2] // 2,))[0]
    spec = jax.sharding.PartitionSpec
    axis = 1 if isinstance(pool, models.Int8Pages) else 2
    return jax.tree.map(
        lambda x: jax.lax.with_sharding_constraint(
            x, spec(*[None] * axis, heads, *[None] * (x.ndim - axis - 1))
        ),
        pool,
    )


def _init_state(cfg, prompt_pages, B: int, T: int, p: PagePlan) -> EngineState:
    """Every slot idle, every response page free, the queue full."""
    S, M, R = p.num_slots, p.table_width, p.num_pages
    prompt_pages, prompt_states = slot_states.split(cfg, prompt_pages)
    first_free = 1 + prompt_pages[0].shape[0]

    def with_free_pages(x):  # the trash page, the prompts' pages, R response pages
        zeros = functools.partial(jnp.zeros, dtype=x.dtype)
        return jnp.concatenate([zeros((1, *x.shape[1:])), x, zeros((R, *x.shape[1:]))])

    kv = tuple(_constrain_pool(jax.tree.map(with_free_pages, x)) for x in prompt_pages)
    kv = slot_states.initial(cfg, kv, prompt_states, S)
    i32 = functools.partial(jnp.zeros, dtype=jnp.int32)
    return EngineState(
        kv=kv,
        seq=jnp.full((S,), -1, jnp.int32),
        t=i32((S,)),
        last=i32((S,)),
        plen=i32((S,)),
        stamp=i32((S,)),
        table=i32((S, M)),
        npages=i32((S,)),
        first_own=i32((S,)),
        copy_src=i32((S,)),
        copy_dst=i32((S,)),
        free=first_free + jnp.arange(R, dtype=jnp.int32),
        free_top=jnp.int32(R),
        next_seq=i32(()),
        requeue=i32((B,)),
        requeue_len=i32(()),
        counter=i32(()),
        tokens=i32((B, T)),
        logprobs=jnp.zeros((B, T), F32),
        length=i32((B,)),
        ended=jnp.zeros((B,), bool),
        steps=i32(()),
        row_steps=i32(()),
        preemptions=i32(()),
    )


def _grant(state: EngineState, p: PagePlan):
    """Pages for running rows that cross a page boundary, oldest first. Returns (state,
    progress [S]: the row decodes this step, stalled [S]: it needed a page and got none)."""
    S, M, R = state.seq.shape[0], p.table_width, p.num_pages
    active = state.seq >= 0
    pos = state.plen + state.t - 1  # position of the token fed this step
    need = active & (pos // p.page_size >= state.npages)
    older = need[None, :] & (state.stamp[None, :] < state.stamp[:, None])
    rank = jnp.sum(older, axis=1, dtype=jnp.int32)
    granted = need & (rank < state.free_top)
    page = state.free[jnp.clip(state.free_top - 1 - rank, 0, R - 1)]
    col = jnp.where(granted, state.npages, M)  # M: out of range, dropped
    table = state.table.at[jnp.arange(S), col].set(page, mode="drop")
    state = state.replace(
        table=table,
        npages=state.npages + granted,
        free_top=state.free_top - jnp.sum(granted, dtype=jnp.int32),
    )
    stalled = need & ~granted
    return state, active & ~stalled, stalled


def _victim(state: EngineState, progress):
    """[S] bool: when running rows exist but none can progress, the youngest holding pages."""
    active = state.seq >= 0
    stuck = jnp.any(active) & ~jnp.any(progress)
    holds = active & (state.npages > state.first_own)
    youngest = jnp.max(jnp.where(holds, state.stamp, -1))
    return stuck & holds & (state.stamp == youngest)


def _decode(cfg, params, layers, state, progress, p: PagePlan, impl: str, shared, group: int):
    """Logits [S, V] of the running rows (rows not progressing write to the trash page).
    `shared`: the prompts' `models.SharedPrefix` where a prompt's pages are read once for
    its rows (G of them: `group`), else None."""
    pos = state.plen + state.t - 1
    S = state.seq.shape[0]
    prefix = None if shared is None else shared.decoding(jnp.where(progress, state.seq, -1), group)
    page = state.table[jnp.arange(S), jnp.clip(pos // p.page_size, 0, p.table_width - 1)]
    logits, kv = models.decode_step_paged(
        cfg,
        params,
        state.kv,
        state.last,
        jnp.maximum(pos, 0),
        jnp.where(progress, page, TRASH),
        jnp.where(progress, pos % p.page_size, 0),
        jnp.where(progress, pos + 1, 1),
        jnp.where(progress[:, None], state.table, TRASH),
        impl=impl,
        layer_params=layers,
        prompt_lens_S=state.plen,
        prefix=prefix,
    )
    return logits, state.replace(kv=slot_states.after_decode(cfg, progress, kv, state.kv))


def _copy_pages(cfg, state: EngineState) -> EngineState:
    """Makes the page copies the last step's admissions owe (a prompt's partly filled last
    page into the slot's own page), before this step's decode writes and reads the pools.

    Why here and not in `_admit`: a pool written after the decode's attention loops read
    it (a write, a nested while_loop reading, then a write) makes XLA copy the whole pool
    twice per layer per step to keep the loop's operand intact; every write before the
    reads lets the pool stay in place (tests/sampling/test_sampling_continuous.py reads the compiled
    program for it)."""

    def copy(pools):
        return tuple(models.copy_pages(pool, state.copy_src, state.copy_dst) for pool in pools)

    kv = slot_states.map_pools(cfg, state.kv, copy)
    none = jnp.full_like(state.copy_src, TRASH)
    return state.replace(kv=kv, copy_src=none, copy_dst=none)


def _admit(state: EngineState, allowed, plen_Q, group: int, B: int, p: PagePlan):
    """Idle slots take the next sequences (preempted ones first), one free page each at
    most (a prompt's partly filled last page, copied at the top of the next step:
    `_copy_pages`). Returns (state, admitted [S])."""
    M, R, ps = p.table_width, p.num_pages, p.page_size
    idle = state.seq < 0
    r = jnp.cumsum(idle, dtype=jnp.int32) - 1
    avail = state.requeue_len + (B - state.next_seq)
    admitted = idle & allowed & (r < jnp.minimum(avail, state.free_top))
    from_requeue = r < state.requeue_len
    requeued = state.requeue[jnp.clip(state.requeue_len - 1 - r, 0, B - 1)]
    seq = jnp.where(from_requeue, requeued, state.next_seq + r - state.requeue_len)
    n_adm = jnp.sum(admitted, dtype=jnp.int32)
    n_req = jnp.minimum(n_adm, state.requeue_len)
    q = jnp.clip(seq, 0, B - 1) // group
    plen = plen_Q[q]
    full, tail = plen // ps, admitted & (plen % ps != 0)
    own = state.free[jnp.clip(state.free_top - jnp.cumsum(tail, dtype=jnp.int32), 0, R - 1)]
    base = 1 + q * p.prompt_pages  # the prompt's first page
    j = jnp.arange(M)[None, :]
    row = jnp.where(j < full[:, None], base[:, None] + j, TRASH)
    row = jnp.where((j == full[:, None]) & tail[:, None], own[:, None], row)
    state = state.replace(
        seq=jnp.where(admitted, seq, state.seq),
        t=jnp.where(admitted, 0, state.t),
        plen=jnp.where(admitted, plen, state.plen),
        stamp=jnp.where(admitted, state.counter + r, state.stamp),
        table=jnp.where(admitted[:, None], row, state.table),
        npages=jnp.where(admitted, full + tail, state.npages),
        first_own=jnp.where(admitted, full, state.first_own),
        copy_src=jnp.where(tail, base + full, state.copy_src),
        copy_dst=jnp.where(tail, own, state.copy_dst),
        free_top=state.free_top - jnp.sum(tail, dtype=jnp.int32),
        next_seq=state.next_seq + n_adm - n_req,
        requeue_len=state.requeue_len - n_req,
        counter=state.counter + n_adm,
    )
    return state, admitted


def _emit(state: EngineState, logits_SV, emit, rng, eos_E, draw, T: int, seq_offset=0):
    """Draws token t of every emitting row with its sequence's key (sequence seq_offset +
    seq: a replica's sequences are a slice of the call's), writes it by sequence index.
    Returns (state, finished [S]: the row's sequence ended)."""
    B = state.tokens.shape[0]
    keys = row_keys(rng, seq_offset + jnp.maximum(state.seq, 0), state.t)
    token, logprob = next_token(logits_SV, keys, *draw)
    row = jnp.where(emit, state.seq, B)  # B: out of range, dropped
    t1 = state.t + emit
    is_end = jnp.any(token[:, None] == eos_E[None, :], axis=-1) & emit
    finished = emit & (is_end | (t1 >= T))
    done_row = jnp.where(finished, state.seq, B)
    state = state.replace(
        tokens=state.tokens.at[row, state.t].set(token, mode="drop"),
        logprobs=state.logprobs.at[row, state.t].set(logprob, mode="drop"),
        length=state.length.at[done_row].set(t1, mode="drop"),
        ended=state.ended.at[done_row].set(is_end, mode="drop"),
        t=t1,
        last=jnp.where(emit, token, state.last),
    )
    return state, finished


def _release(state: EngineState, finished, victim, p: PagePlan):
    """Frees the own pages of finished and preempted rows; requeues the preempted."""
    B = state.requeue.shape[0]
    rel = finished | victim
    j = jnp.arange(p.table_width)[None, :]
    own = rel[:, None] & (j >= state.first_own[:, None]) & (j < state.npages[:, None])
    flat = own.reshape(-1)
    at = jnp.where(flat, state.free_top + jnp.cumsum(flat, dtype=jnp.int32) - 1, p.num_pages)
    back = jnp.where(victim, state.requeue_len, B)
    return state.replace(
        free=state.free.at[at].set(state.table.reshape(-1), mode="drop"),
        free_top=state.free_top + jnp.sum(flat, dtype=jnp.int32),
        requeue=state.requeue.at[back].set(state.seq, mode="drop"),
        requeue_len=state.requeue_len + jnp.sum(victim, dtype=jnp.int32),
        preemptions=state.preemptions + jnp.sum(victim, dtype=jnp.int32),
        seq=jnp.where(rel, -1, state.seq),
        npages=jnp.where(rel, 0, state.npages),
        copy_src=jnp.where(rel, TRASH, state.copy_src),
        copy_dst=jnp.where(rel, TRASH, state.copy_dst),
    )


@functools.partial(
    jax.jit,
    static_argnames=(
        "model_config",
        "num_sequences",
        "max_new_tokens",
        "page_plan",
        "temperature",
        "top_k",
        "top_p",
        "impl",
        "drain_levels",
        "layout",
        "replicas",
        "shared_prefix",
    ),
)
def engine_loop(
    model_config,
    params,
    prompt_pages,
    plen_Q,
    logits_QV,
    rng,
    eos_ids_E,
    pad_id,
    *,
    num_sequences,
    max_new_tokens,
    page_plan,
    temperature,
    top_k,
    top_p,
    impl,
    drain_levels=None,
    layout="trainer",
    replicas=(),
    shared_prefix=True,
):
    """The continuous loop. Returns (tokens [B, T] pad after the end, mask [B, T],
    logprobs [B, T] 0 where masked, lengths [B], truncated [B], loop steps, row steps,
    preemptions). `layout`: the rules the loop is traced under (`sharding.layout_rules`).

    `replicas` (mesh axes, `replica_axes`): the loop runs once per replica, in a shard_map
    over those axes, on the replica's slice of the prompts (its pages, lengths, logits)
    with `page_plan` as each replica's (its slots and pages): a replica's pool, page table
    and queue stay on its chips, and the other mesh axes split the model inside it. Rows
    come out split over the replicas in sequence order; row steps and preemptions are
    summed over them, loop steps are the longest replica's.

    `shared_prefix`: with int8 pages and G > 1 sequences per prompt, each decode step
    reads a prompt's pages once for all its rows (`models.SharedPrefix`, cascade
    attention); elsewhere (float pages, one sequence per prompt) it changes nothing."""
    draw = (temperature, top_k, top_p)
    args = (model_config, params, prompt_pages, plen_Q, logits_QV, rng, eos_ids_E, pad_id)
    static = (max_new_tokens, page_plan, draw, impl, drain_levels, shared_prefix)
    rules = sharding.layout_rules(layout)
    if replicas:
        rules = sharding.LOGICAL_RULES if rules is None else rules
        return replicas_lib.per_replica(_engine_body, args, num_sequences, static, rules, replicas)
    with partition.layout(rules):
        return _engine_body(*args, num_sequences, *static)


def _engine_body(
    model_config,
    params,
    prompt_pages,
    plen_Q,
    logits_QV,
    rng,
    eos_ids_E,
    pad_id,
    num_sequences,
    max_new_tokens,
    page_plan,
    draw,
    impl,
    drain_levels,
    shared_prefix=False,
    seq_offset=0,
):
    cfg, B, T, p = model_config, num_sequences, max_new_tokens, page_plan
    group = B // plen_Q.shape[0]
    pools = slot_states.split(cfg, prompt_pages)[0]
    logits_QV, prompt_states = slot_states.prompt_rows(cfg, prompt_pages, logits_QV)
    int8 = isinstance(pools[0], models.Int8Pages)
    shared = None
    if shared_prefix and int8 and group > 1:  # prompt q's pages: 1 + q · prompt_pages, ...
        first_Q = 1 + jnp.arange(plen_Q.shape[0], dtype=jnp.int32) * p.prompt_pages
        shared = models.SharedPrefix.of_prompts(plen_Q, first_Q, p.page_size, p.prompt_pages)
    params = models.for_decoding(cfg, params)  # weights gathered once, not once per token
    layers = models.split_layers(cfg, params)

    def body(state):
        state = _copy_pages(cfg, state)
        state, progress, stalled = _grant(state, p)
        victim = _victim(state, progress)
        decoded, state = _decode(cfg, params, layers, state, progress, p, impl, shared, group)
        allowed = ~jnp.any(stalled) & ~jnp.any(victim)
        state, admitted = _admit(state, allowed, plen_Q, group, B, p)
        q_S = jnp.clip(state.seq, 0, B - 1) // group
        first = logits_QV[q_S]
        state = state.replace(kv=slot_states.admit(cfg, state.kv, admitted, q_S, prompt_states))
        logits = jnp.where(admitted[:, None], first, decoded)
        emit = progress | admitted
        state, finished = _emit(state, logits, emit, rng, eos_ids_E, draw, T, seq_offset)
        state = _release(state, finished, victim, p)
        width = state.seq.shape[0]
        return state.replace(steps=state.steps + 1, row_steps=state.row_steps + width)

    def cond(narrower: int):
        def go_on(state):
            queued = (state.next_seq < B) | (state.requeue_len > 0)
            return queued | (jnp.sum(state.seq >= 0) > narrower)

        return go_on

    # One while_loop per width: once the queue is empty and at most half the slots run,
    # the running rows move to a loop of half the width (the pages stay where they are).
    widths = drain_widths(p.num_slots, drain_levels)
    state = _init_state(cfg, prompt_pages, B, T, p)
    for k, width in enumerate(widths):
        if k:
            state = _compact(cfg, state, width)
        narrower = widths[k + 1] if k + 1 < len(widths) else 0
        state = jax.lax.while_loop(cond(narrower), body, state)
    mask = jnp.arange(T)[None, :] < state.length[:, None]
    return (
        jnp.where(mask, state.tokens, pad_id),
        mask.astype(jnp.int32),
        jnp.where(mask, state.logprobs, 0.0),
        state.length,
        ~state.ended,
        state.steps,
        state.row_steps,
        state.preemptions,
    )


def _compact(cfg, state: EngineState, width: int) -> EngineState:
    """The running slots (at most `width`) moved to the first `width` slots; the per-slot
    arrays shrink to them."""
    order = jnp.argsort(state.seq < 0, stable=True)[:width]  # running slots first
    per_slot = ("seq", "t", "last", "plen", "stamp", "table", "npages", "first_own")
    per_slot += ("copy_src", "copy_dst")
    kv = slot_states.compact(cfg, state.kv, order)
    return state.replace(kv=kv, **{name: getattr(state, name)[order] for name in per_slot})


def run(cfg, params, tokens_NP, mask_NP, rng, eos_ids, pad_id, *, options, page_plan):
    """Prefill + engine on checked inputs (sampler.sample validates). Returns (tokens, mask,
    logprobs, lengths, truncated, prompt tokens [B, P], prompt mask [B, P], EngineStats)."""
    G = options.num_samples
    pages, plen, logits, tokens_BP, mask_BP = prefill_pages(
        cfg,
        params,
        tokens_NP,
        mask_NP,
        num_samples=G,
        share_prefix=options.share_prefix,
        page_size=page_plan.page_size,
        layout=options.layout,
        kv_dtype=options.kv_dtype,
    )
    B = tokens_NP.shape[0] * G
    layout = options.layout
    replicas, local_plan = replica_axes(
        partition.context_mesh(), layout, tokens_NP.shape[0], page_plan
    )
    tokens, mask, logprobs, lengths, truncated, steps, row_steps, preempted = engine_loop(
        cfg,
        params,
        pages,
        plen,
        logits,
        rng,
        eos_ids,
        pad_id,
        num_sequences=B,
        max_new_tokens=options.max_new_tokens,
        page_plan=local_plan,
        temperature=options.temperature,
        top_k=options.top_k,
        top_p=options.top_p,
        impl=models.paged_attention_impl(cfg.attention_impl, None, cfg.head_dim, options.kv_dtype),
        drain_levels=options.drain_levels,
        layout=layout,
        replicas=replicas,
        shared_prefix=options.shared_prefix_attention,
    )
    rows = replicas_lib.row_sharding(tokens_NP)
    if rows is not None:
        tokens, mask, logprobs, lengths, truncated, tokens_BP, mask_BP = replicas_lib.place(
            rows, (tokens, mask, logprobs, lengths, truncated, tokens_BP, mask_BP)
        )
    stats = EngineStats(steps=steps, row_steps=row_steps, preemptions=preempted)
    return tokens, mask, logprobs, lengths, truncated, tokens_BP, mask_BP, stats
