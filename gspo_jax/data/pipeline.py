"""Prompt and supervised (warm-start) batch pipelines: records -> chat template -> padded arrays.

Where it sits: ``build_dataset`` gives random-access sources (``tfds.data_source``); this module
reads a source (or this process's record shard of it) through grain, renders each question with the
tokenizer's chat template, tokenizes and pads it once (``prepare_prompts`` / ``prepare_sft``),
and serves batches from a grain index pipeline (``PreparedData.iterator``). The trainer feeds
``prompt_tokens``/``prompt_mask`` to the sampler and ``reference`` to the reward.

Shapes: E examples in the prepared data, N rows per batch, P prompt length, R response
(answer) length of the supervised stream, L = P + R.

Rules a caller relies on:

- Two ways to split the data over JAX processes:
  record shards: process ``i`` of ``n`` prepares records ``i, i + n, i + 2n, ...`` of the
  source (disjoint, union = all; ``shard_index`` / ``shard_count``, by default
  ``jax.process_index()`` / ``jax.process_count()``) and iterates over them alone (the
  supervised warm start);
  row shards: every process prepares the whole source (``shard_index=0, shard_count=1``),
  iterates the same global batches of N rows and keeps only its own ``rows`` of each
  (``iterator(N, rows=...)``). The global batches, and so the RL step, do not depend on the
  number of processes, and an iterator position saved by one process count resumes under
  another (the RL prompts and evaluation). Every process then holds the whole split's
  tokens: [E, P] int32, 4 MB for 1000 prompts of 1024 tokens.
- Order: training iterators shuffle with ``seed`` (same seed -> same order), reshuffle every
  epoch (the epoch number is mixed into the seed) and repeat forever; batches are full and may
  straddle an epoch boundary. Evaluation iterators make one pass in source order and pad the
  last batch to N rows by repeating the shard's last example with ``valid = 0``; every process
  gets the same number of batches, ``ceil(ceil(len(source) / n) / N)``.
- Prompts are left-padded with the tokenizer's pad token to P: ``prompt_mask`` is 1 on real
  tokens, 0 on padding.
- Overlong examples (``overlong=``): ``"error"`` (default) raises at preparation time, naming the
  count, the longest length and an example id; ``"drop"`` skips them and reports the count as
  ``num_dropped`` (logged). Nothing is truncated.
- Iterator state: ``get_state()`` is a JSON-serialisable dict (grain position plus a
  fingerprint of the data and settings); ``set_state`` refuses a state from a different
  pipeline and otherwise resumes exactly where the saved iterator was.
- Supervised target (the synthetic task's answer format): the assistant turn is
  ``"#### <answer>"`` followed by ``<|im_end|>``; ``loss_mask`` is 1 exactly on those tokens.
  The arithmetic reward must accept this format (the integer after ``#### ``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

import grain
import numpy as np
import transformers
from absl import logging

from gspo_jax.data.templates import (  # noqa: F401 (build_messages: the module's names of old)
    DEFAULT_INSTRUCTION,
    build_messages,
    render_prompt,
)
from gspo_jax.data.tokenizer import IM_END

ANSWER_PREFIX = "#### "
DEFAULT_TARGET_TEMPLATE = ANSWER_PREFIX + "{answer}"
OVERLONG_POLICIES = ("error", "drop")

# The data are in memory after preparation; a batch is one numpy gather, so grain's reader
# threads would only add non-determinism in timing and memory. Read synchronously.
_SYNC_READ = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)

# Records per batched read of the source during preparation.
_READ_CHUNK = 1024


def format_answer(answer: str) -> str:
    """The synthetic task's answer text: ``"#### <answer>"`` (the end token is added apart)."""
    return f"{ANSWER_PREFIX}{answer}"


def decode_record(record: Mapping[str, Any]) -> dict[str, Any]:
    """A TFDS record with text features as ``str`` (data sources return them as bytes)."""
    out = {}
    for key, value in record.items():
        if isinstance(value, np.generic) or (isinstance(value, np.ndarray) and value.ndim == 0):
            value = value.item()
        if isinstance(value, bytes):
            value = value.decode("utf-8")
        out[key] = value
    return out


def resolve_shard(
    shard_index: int | None = None, shard_count: int | None = None
) -> tuple[int, int]:
    """(index, count) of this process's shard; defaults to the JAX process index and count."""
    if (shard_index is None) != (shard_count is None):
        raise ValueError(
            f"Pass both shard_index and shard_count or neither (got {shard_index}, {shard_count})."
        )
    if shard_index is None:
        import jax  # Deferred: only the default needs the JAX runtime.

        return jax.process_index(), jax.process_count()
    if not 0 <= shard_index < shard_count:
        raise ValueError(f"shard_index={shard_index} not in [0, shard_count={shard_count}).")
    return int(shard_index), int(shard_count)


def _read_records(source: Sequence[Any], index_K: np.ndarray) -> list[dict[str, Any]]:
    indices = index_K.tolist()
    # TFDS array_record sources decode a batch of records much faster than one at a time.
    getitems = getattr(source, "__getitems__", None)
    records = getitems(indices) if getitems is not None else [source[i] for i in indices]
    return [decode_record(r) for r in records]


def read_shard(source: Sequence[Any], shard_index: int, shard_count: int) -> list[dict[str, Any]]:
    """Decoded records ``shard_index, shard_index + shard_count, ...`` of a random-access source."""
    chunks = (
        grain.MapDataset.range(len(source))[shard_index::shard_count]
        .batch(_READ_CHUNK)
        .map(lambda index_K: _read_records(source, index_K))
    )
    return [record for chunk in chunks.to_iter_dataset(_SYNC_READ) for record in chunk]


def _field(record: Mapping[str, Any], key: str) -> str:
    if key not in record:
        raise KeyError(f"Record has no field {key!r}; fields: {sorted(record)}.")
    return str(record[key])


def _apply_overlong_policy(
    too_long: np.ndarray, lengths: np.ndarray, ids: list[str], limit: str, overlong: str, where: str
) -> np.ndarray:
    """Indices of kept examples; raises under ``"error"`` if any example is too long."""
    if overlong not in OVERLONG_POLICIES:
        raise ValueError(f"overlong={overlong!r}; use one of {OVERLONG_POLICIES}.")
    count = int(too_long.sum())
    if count and overlong == "error":
        worst = int(np.argmax(np.where(too_long, lengths, -1)))
        raise ValueError(
            f"{count} of {len(too_long)} examples in {where} exceed {limit} (longest: "
            f"{int(lengths[worst])} tokens, example id {ids[worst]!r}). Raise the length "
            "(config.prompt_length / response_length) or skip them with "
            "config.data.overlong='drop' (overlong='drop'; counted as num_dropped)."
        )
    if count:
        logging.warning(
            "Dropping %d of %d examples in %s: over %s.", count, len(too_long), where, limit
        )
    return np.flatnonzero(~too_long)


def _fingerprint(arrays: Mapping[str, np.ndarray]) -> str:
    digest = hashlib.sha256()
    for key in sorted(arrays):
        value = arrays[key]
        digest.update(key.encode())
        if value.dtype.kind in "UO":
            digest.update("\x00".join(value.tolist()).encode("utf-8"))
        else:
            digest.update(np.ascontiguousarray(value).tobytes())
    return digest.hexdigest()[:16]


@dataclasses.dataclass(frozen=True, eq=False)
class PreparedData:
    """One process's shard, encoded and padded; ``iterator()`` serves batches from it.

    Attributes:
      kind: ``"prompt"`` or ``"sft"``.
      arrays: batch fields, each with leading dimension E (row e is example e of the shard).
      num_dropped: examples of this shard skipped by ``overlong="drop"``.
      max_length: longest encoded prompt (prompt kind) or prompt + target (sft kind) in the
        shard before dropping, in tokens; for sizing ``prompt_length``.
      shard_index, shard_count: this process's shard of the source.
      source_size: records in the whole source (all shards).
      fingerprint: hash of ``arrays``; guards iterator states against a changed pipeline.
    """

    kind: str
    arrays: dict[str, np.ndarray]
    num_dropped: int
    max_length: int
    shard_index: int
    shard_count: int
    source_size: int
    fingerprint: str

    @property
    def num_examples(self) -> int:
        return len(next(iter(self.arrays.values())))

    def iterator(
        self,
        batch_size: int,
        *,
        seed: int = 0,
        train: bool = True,
        rows: Sequence[int] | None = None,
    ) -> BatchIterator:
        """Training (shuffled, infinite) or evaluation (one ordered, padded pass) batches of
        `batch_size` rows, or only rows `rows` of each (this process's; see the module
        docstring's row shards)."""
        return BatchIterator(self, batch_size=batch_size, seed=seed, train=train, rows=rows)


class BatchIterator:
    """Iterator of batch dicts over a ``PreparedData`` with saveable position.

    Each batch holds the ``PreparedData.arrays`` rows of its examples plus ``valid`` int32 [N]
    (0 only on evaluation padding rows). With ``rows``, each batch is those rows (in that
    order) of the batch of ``batch_size`` rows the iterator would otherwise serve; the
    position (``get_state``) counts whole batches, so it does not depend on ``rows``.
    """

    def __init__(
        self,
        data: PreparedData,
        *,
        batch_size: int,
        seed: int,
        train: bool,
        rows: Sequence[int] | None = None,
    ):
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}.")
        self.rows = _check_rows(rows, batch_size, data.shard_count)
        if not 0 <= seed < 2**32:
            raise ValueError(f"seed must be in [0, 2**32), got {seed}.")
        if data.num_examples == 0:
            raise ValueError(
                f"Shard {data.shard_index}/{data.shard_count} has no examples (source size "
                f"{data.source_size}, dropped {data.num_dropped}); nothing to iterate."
            )
        self.data = data
        self.batch_size = batch_size
        self.train = train
        num_examples = data.num_examples
        if train:
            self.num_batches = None
            indices = grain.MapDataset.range(num_examples)
            if num_examples > 1:  # index_shuffle needs at least two elements.
                indices = indices.shuffle(seed)
            indices = indices.repeat(None).batch(batch_size, drop_remainder=True)
        else:
            per_process = math.ceil(data.source_size / data.shard_count)
            self.num_batches = math.ceil(per_process / batch_size)
            indices = grain.MapDataset.range(self.num_batches * batch_size).batch(batch_size)
        self._iterator = iter(indices.map(self._gather).to_iter_dataset(_SYNC_READ))
        self._batches_served = 0
        self._identity = {
            "kind": data.kind,
            "fingerprint": data.fingerprint,
            "shard_index": data.shard_index,
            "shard_count": data.shard_count,
            "batch_size": batch_size,
            "seed": int(seed),
            "train": bool(train),
        }

    def _gather(self, index_N: np.ndarray) -> dict[str, np.ndarray]:
        index_N = index_N[self.rows]
        num_examples = self.data.num_examples
        if self.train:
            valid_N = np.ones(index_N.shape, bool)
            rows_N = index_N % num_examples  # grain's range already wraps; be explicit.
        else:
            valid_N = index_N < num_examples
            # Evaluation padding rows repeat the last example; `valid` marks them.
            rows_N = np.minimum(index_N, num_examples - 1)
        batch = {key: value[rows_N] for key, value in self.data.arrays.items()}
        batch["valid"] = valid_N.astype(np.int32)
        return batch

    def __iter__(self) -> BatchIterator:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        batch = next(self._iterator)
        self._batches_served += 1
        return batch

    @property
    def epoch(self) -> float:
        """Passes over this shard served so far (fractional)."""
        return self._batches_served * self.batch_size / self.data.num_examples

    def get_state(self) -> dict[str, Any]:
        """JSON-serialisable position (store it in the checkpoint)."""
        return {
            "position": self._iterator.get_state(),
            "batches_served": self._batches_served,
            "pipeline": dict(self._identity),
        }

    def set_state(self, state: Mapping[str, Any]) -> None:
        """Resumes at a saved position; the state must come from an identical pipeline."""
        if isinstance(state, (str, bytes)):
            state = json.loads(state)
        saved = state.get("pipeline")
        if not isinstance(saved, Mapping):
            raise TypeError(f"Not a BatchIterator state (no 'pipeline' entry): {state!r}.")
        mismatched = {
            key: (saved.get(key), value)
            for key, value in self._identity.items()
            if saved.get(key) != value
        }
        if mismatched:
            details = ", ".join(
                f"{k}: saved {s!r} vs now {n!r}" for k, (s, n) in mismatched.items()
            )
            raise ValueError(f"Iterator state is from a different data pipeline ({details}).")
        self._iterator.set_state(state["position"])
        self._batches_served = int(state["batches_served"])


def _check_rows(rows, batch_size: int, shard_count: int) -> np.ndarray:
    """`rows` as distinct int indices into a batch of `batch_size` (default: all of them)."""
    if rows is None:
        return np.arange(batch_size)
    if shard_count > 1:
        raise ValueError(
            f"rows= splits global batches over processes, but this data is already one of "
            f"{shard_count} record shards; prepare it with shard_index=0, shard_count=1."
        )
    out = np.asarray(rows)
    if (
        out.ndim != 1
        or out.size == 0
        or not np.issubdtype(out.dtype, np.integer)
        or out.min() < 0
        or out.max() >= batch_size
        or len(np.unique(out)) != out.size
    ):
        raise ValueError(
            f"rows must be distinct int indices into a batch of {batch_size}, got {rows!r}."
        )
    return out


def _left_pad(
    rows: Sequence[Sequence[int]], length: int, pad_id: int
) -> tuple[np.ndarray, np.ndarray]:
    """Right-aligns each row in [len(rows), length]; returns (tokens, mask) int32."""
    tokens = np.full((len(rows), length), pad_id, np.int32)
    mask = np.zeros((len(rows), length), np.int32)
    for e, row in enumerate(rows):
        if row:
            tokens[e, length - len(row) :] = row
            mask[e, length - len(row) :] = 1
    return tokens, mask


def _encode_prompts(
    records: Sequence[Mapping[str, Any]],
    tokenizer: transformers.PreTrainedTokenizerBase,
    question_key: str,
    system_prompt: str | None,
    instruction: str | None,
    chat_template: str | None,
    chat_template_kwargs: Mapping[str, Any] | None,
) -> tuple[list[str], list[list[int]]]:
    texts = [
        render_prompt(
            tokenizer,
            _field(r, question_key),
            system_prompt=system_prompt,
            instruction=instruction,
            chat_template=chat_template,
            chat_template_kwargs=chat_template_kwargs,
        )
        for r in records
    ]
    # The template already holds every special token; tokenize the text as is.
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
    return texts, [list(x) for x in ids]


def _strings(values: Sequence[str]) -> np.ndarray:
    return np.asarray(list(values), dtype=str) if values else np.zeros((0,), dtype=str)


def prepare_prompts(
    source: Sequence[Any],
    tokenizer: transformers.PreTrainedTokenizerBase,
    *,
    prompt_length: int,
    question_key: str = "question",
    reference_key: str = "answer",
    id_key: str = "id",
    system_prompt: str | None = None,
    instruction: str | None = DEFAULT_INSTRUCTION,
    chat_template: str | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    overlong: str = "error",
    shard_index: int | None = None,
    shard_count: int | None = None,
) -> PreparedData:
    """Reads, templates, tokenizes and left-pads this process's shard of prompts.

    Batch fields (N rows): ``prompt_tokens`` int32 [N, P], ``prompt_mask`` int32 [N, P] (1 =
    real token, left padded), ``prompt_text`` str [N] (the templated text), ``question`` str
    [N], ``reference`` str [N] (``record[reference_key]``: "answer" for the synthetic task,
    "final_answer" for GSM8K), ``example_id`` str [N], ``valid`` int32 [N]; and where the
    records carry their own fields (``record["example"]``: a JSONL line or a table row, as
    JSON text; `data.name="jsonl"`, `"parquet"`, `"hf"`) ``example`` object [N] of that
    text, which rewards that ask for it get as a dict (rollout/scoring.py).
    """
    if prompt_length < 1:
        raise ValueError(f"prompt_length must be positive, got {prompt_length}.")
    shard_index, shard_count = resolve_shard(shard_index, shard_count)
    records = read_shard(source, shard_index, shard_count)
    template = (chat_template, chat_template_kwargs)
    texts, ids = _encode_prompts(
        records, tokenizer, question_key, system_prompt, instruction, *template
    )
    example_ids = [_field(r, id_key) for r in records]
    lengths = np.asarray([len(x) for x in ids], np.int64)
    keep = _apply_overlong_policy(
        lengths > prompt_length,
        lengths,
        example_ids,
        f"prompt_length={prompt_length} tokens",
        overlong,
        f"shard {shard_index}/{shard_count}",
    )
    tokens_EP, mask_EP = _left_pad([ids[e] for e in keep], prompt_length, tokenizer.pad_token_id)
    arrays = {
        "prompt_tokens": tokens_EP,
        "prompt_mask": mask_EP,
        "prompt_text": _strings([texts[e] for e in keep]),
        "question": _strings([_field(records[e], question_key) for e in keep]),
        "reference": _strings([_field(records[e], reference_key) for e in keep]),
        "example_id": _strings([example_ids[e] for e in keep]),
    }
    if records and "example" in records[0]:  # the record's own fields, as JSON text
        arrays["example"] = np.asarray([records[e]["example"] for e in keep] or [], dtype=object)
    return PreparedData(
        kind="prompt",
        arrays=arrays,
        num_dropped=len(records) - len(keep),
        max_length=int(lengths.max(initial=0)),
        shard_index=shard_index,
        shard_count=shard_count,
        source_size=len(source),
        fingerprint=_fingerprint(arrays),
    )


def prepare_sft(
    source: Sequence[Any],
    tokenizer: transformers.PreTrainedTokenizerBase,
    *,
    prompt_length: int,
    response_length: int,
    question_key: str = "question",
    answer_key: str = "answer",
    id_key: str = "id",
    target_template: str = DEFAULT_TARGET_TEMPLATE,
    end_token: str = IM_END,
    system_prompt: str | None = None,
    instruction: str | None = DEFAULT_INSTRUCTION,
    chat_template: str | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    overlong: str = "error",
    shard_index: int | None = None,
    shard_count: int | None = None,
) -> PreparedData:
    """Supervised warm-start examples: templated prompt, then the target answer and end token.

    Layout mirrors RL rollouts so positions match what the sampler sees: the prompt is
    left-padded into the first P columns, the target ``target_template.format(answer=...)``
    plus ``end_token`` starts at column P and is right-padded to R columns.

    Batch fields (N rows): ``tokens`` int32 [N, L], ``attention_mask`` int32 [N, L] (1 = real
    token), ``loss_mask`` int32 [N, L] (1 exactly on the target tokens including the end token:
    ``loss_mask[n, t] = 1`` means ``tokens[n, t]`` is predicted from position t - 1),
    ``prompt_text``, ``target_text``, ``question``, ``reference`` (``record[answer_key]``),
    ``example_id`` (str [N]) and ``valid`` int32 [N].
    """
    if prompt_length < 1 or response_length < 1:
        raise ValueError(
            f"prompt_length and response_length must be positive, got {prompt_length}, "
            f"{response_length}."
        )
    vocab = tokenizer.get_vocab()
    if end_token not in vocab:
        raise ValueError(f"end_token {end_token!r} is not in the tokenizer's vocabulary.")
    shard_index, shard_count = resolve_shard(shard_index, shard_count)
    records = read_shard(source, shard_index, shard_count)
    template = (chat_template, chat_template_kwargs)
    texts, prompt_ids = _encode_prompts(
        records, tokenizer, question_key, system_prompt, instruction, *template
    )
    targets = [target_template.format(answer=_field(r, answer_key)) for r in records]
    target_ids = tokenizer(targets, add_special_tokens=False)["input_ids"] if targets else []
    target_ids = [list(x) + [vocab[end_token]] for x in target_ids]
    example_ids = [_field(r, id_key) for r in records]
    prompt_lengths = np.asarray([len(x) for x in prompt_ids], np.int64)
    target_lengths = np.asarray([len(x) for x in target_ids], np.int64)
    keep = _apply_overlong_policy(
        (prompt_lengths > prompt_length) | (target_lengths > response_length),
        prompt_lengths + target_lengths,
        example_ids,
        f"prompt_length={prompt_length} or response_length={response_length} tokens",
        overlong,
        f"shard {shard_index}/{shard_count}",
    )
    prompt_EP, prompt_mask_EP = _left_pad(
        [prompt_ids[e] for e in keep], prompt_length, tokenizer.pad_token_id
    )
    target_ER = np.full((len(keep), response_length), tokenizer.pad_token_id, np.int32)
    target_mask_ER = np.zeros((len(keep), response_length), np.int32)
    for row, e in enumerate(keep):
        target_ER[row, : len(target_ids[e])] = target_ids[e]
        target_mask_ER[row, : len(target_ids[e])] = 1
    arrays = {
        "tokens": np.concatenate([prompt_EP, target_ER], axis=1),
        "attention_mask": np.concatenate([prompt_mask_EP, target_mask_ER], axis=1),
        "loss_mask": np.concatenate([np.zeros_like(prompt_mask_EP), target_mask_ER], axis=1),
        "prompt_text": _strings([texts[e] for e in keep]),
        "target_text": _strings([targets[e] for e in keep]),
        "question": _strings([_field(records[e], question_key) for e in keep]),
        "reference": _strings([_field(records[e], answer_key) for e in keep]),
        "example_id": _strings([example_ids[e] for e in keep]),
    }
    return PreparedData(
        kind="sft",
        arrays=arrays,
        num_dropped=len(records) - len(keep),
        max_length=int((prompt_lengths + target_lengths).max(initial=0)),
        shard_index=shard_index,
        shard_count=shard_count,
        source_size=len(source),
        fingerprint=_fingerprint(arrays),
    )


def make_prompt_iterator(
    source: Sequence[Any],
    tokenizer: transformers.PreTrainedTokenizerBase,
    *,
    batch_size: int,
    prompt_length: int,
    seed: int = 0,
    train: bool = True,
    **prepare_kwargs: Any,
) -> BatchIterator:
    """``prepare_prompts(source, tokenizer, ...).iterator(batch_size, seed=, train=)``."""
    data = prepare_prompts(source, tokenizer, prompt_length=prompt_length, **prepare_kwargs)
    return data.iterator(batch_size, seed=seed, train=train)


def make_sft_iterator(
    source: Sequence[Any],
    tokenizer: transformers.PreTrainedTokenizerBase,
    *,
    batch_size: int,
    prompt_length: int,
    response_length: int,
    seed: int = 0,
    train: bool = True,
    **prepare_kwargs: Any,
) -> BatchIterator:
    """``prepare_sft(source, tokenizer, ...).iterator(batch_size, seed=, train=)``."""
    data = prepare_sft(
        source,
        tokenizer,
        prompt_length=prompt_length,
        response_length=response_length,
        **prepare_kwargs,
    )
    return data.iterator(batch_size, seed=seed, train=train)
