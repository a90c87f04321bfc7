"""The §5.4 noise floor against response length: does averaging the per-token
train/inference log-prob gap over |y_i| tokens bring GSPO's sequence ratio
s_i = exp(mean_t(log π_train − log π_old)) within the clip range ε = 3e-4 / 4e-4 for long
responses?

At learning rate 0 the policy never changes, so every s_i ≠ 1 is noise. For each response
length, compute dtype (bf16, f32) and π_old source (run.PI_OLD_SOURCES) this samples
rollouts of 64 rows with the end tokens disabled (`eos_ids=()`: every response runs to the
full length, which random weights would otherwise end early) and trains on each at lr 0:

  from the train step   max |s_i − 1| over its updates, the fraction of sequences whose
                        clip binds (clipfrac_seq) and whose ratio is out of range
                        (clipfrac_seq_range), averaged over the updates (= over all rows)
  from a per-token pass log π_train [B, T] as the updates compute it (the same strided
                        micro-batches), against π_old: per token d_t = log π_train −
                        log π_old, per sequence log s_i = mean_t d_t; their spreads
                        (std over valid tokens, std over sequences) and the ratio of the
                        two, which is 1/sqrt(L) when the token gaps are independent

Rows are cached per length in <root>/noise_floor_length/L<n>.json (a rerun measures only
the lengths it lacks)."""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import time
from collections.abc import Sequence

import numpy as np

from experiments.gspo_vs_grpo.run import (
    PI_OLD_SOURCES,
    _noise_floor_config,
    _with_whole_batch_logprobs,
    record_seconds,
)

log = logging.getLogger("experiments")

LENGTHS = (16, 64, 256, 1024)  # the published sweep (--noise_floor_lengths)
DTYPES = ("bfloat16", "float32")


def parse_lengths(text: str) -> tuple[int, ...]:
    """'16,64,256' -> (16, 64, 256); '' -> () (no sweep). Each a positive int, no repeats."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    try:
        lengths = tuple(int(p) for p in parts)
    except ValueError:
        raise ValueError(
            f"--noise_floor_lengths={text!r}: expected comma-separated integers, e.g. 16,64"
        ) from None
    if any(n < 1 for n in lengths) or len(set(lengths)) != len(lengths):
        raise ValueError(
            f"--noise_floor_lengths={text!r}: response lengths must be distinct and >= 1"
        )
    return lengths


def noise_floor_lengths(
    root: str,
    lengths: Sequence[int],
    *,
    rollouts: int = 2,
    dtypes: Sequence[str] = DTYPES,
    sources: Sequence[str] = PI_OLD_SOURCES,
    devices=None,
) -> list[dict]:
    """One row per (length, dtype, π_old source), lengths in the order given, from
    `rollouts` rollouts of 64 rows each; each length's rows cached in
    <root>/noise_floor_length/L<n>.json (reused when it holds every dtype and source asked
    for, from as many rollouts).
    `devices`: the runs' devices (None: all, as `setup.setup`)."""
    for name, got, known in (("dtypes", dtypes, DTYPES), ("sources", sources, PI_OLD_SOURCES)):
        if not got or set(got) - set(known):
            raise ValueError(f"noise_floor_lengths: {name}={list(got)}, not a subset of {known}")
    rows = []
    for length in lengths:
        cached = os.path.join(root, "noise_floor_length", f"L{length}.json")
        if os.path.exists(cached):
            with open(cached) as f:
                got = json.load(f)
            have = {(r["dtype"], r["pi_old"]) for r in got if r["rollouts"] == rollouts}
            if have >= {(d, s) for d in dtypes for s in sources}:
                rows += [r for r in got if r["dtype"] in dtypes and r["pi_old"] in sources]
                continue
        t0 = time.perf_counter()
        got = []
        for dtype in dtypes:
            got += _length_rows(root, length, dtype, rollouts, sources, devices)
        os.makedirs(os.path.dirname(cached), exist_ok=True)
        with open(cached, "w") as f:
            json.dump(got, f, indent=1)
        record_seconds(root, f"noise_floor_length/L{length}", time.perf_counter() - t0)
        rows += got
    return rows


def cached_rows(root: str) -> list[dict]:
    """Every row cached under <root>/noise_floor_length/, by length ([] when none)."""
    folder = os.path.join(root, "noise_floor_length")
    names = os.listdir(folder) if os.path.isdir(folder) else []
    rows = []
    for name in names:
        if name.startswith("L") and name.endswith(".json"):
            with open(os.path.join(folder, name)) as f:
                rows += json.load(f)
    return sorted(rows, key=lambda r: r["length"])


def _length_rows(root, length: int, dtype: str, rollouts: int, sources, devices) -> list[dict]:
    """The rows of one (length, dtype): the same `rollouts` full-length rollouts, trained on
    at lr 0 with π_old from each source."""
    import gspo_jax.rewards.testing  # noqa: F401  (registers test_checksum)
    from gspo_jax.trainer import loop, setup

    c = _noise_floor_config(dtype, root)
    c.response_length = length
    workdir = os.path.join(root, "noise_floor_length", f"L{length}_{dtype}_{time.time_ns()}")
    trainer = setup.setup(c, workdir, devices=devices)
    # No end token: every row samples `length` tokens (the bound sampler's other options kept).
    sample = functools.partial(trainer.rollouts.sample, eos_ids=())
    trainer = dataclasses.replace(
        trainer, rollouts=dataclasses.replace(trainer.rollouts, sample=sample)
    )
    rows = []
    try:
        state = loop.init_or_restore(trainer)
        outs = [trainer.rollouts.collect(state, next(trainer.train_iter)) for _ in range(rollouts)]
        fns = _compiled(trainer)
        for source in sources:
            cell = _cell(trainer, fns, state, outs, source)
            rows.append({"length": length, "dtype": dtype, "pi_old": source, **cell})
            log.info("noise floor against length: %s", rows[-1])
    finally:
        trainer.close()
    return rows


def _compiled(trainer) -> dict:
    """The jitted functions every cell of a run shares: the train step per π_old kind
    (whole_batch feeds the sampler kind other log-probs) and the per-token pass."""
    import jax

    from gspo_jax.train_step import make_train_step

    fns = {}
    for kind in ("recompute", "sampler"):
        sc = dataclasses.replace(trainer.step_config, old_logprobs_source=kind)
        step = make_train_step(
            sc, trainer.tx, state_shardings=trainer.state_shardings.train, mesh=trainer.mesh
        )
        fns[kind] = dataclasses.replace(trainer, step_config=sc, train_step=step)
    fns["pass"] = jax.jit(functools.partial(train_pass_logprobs, trainer.step_config))
    return fns


def _cell(trainer, fns: dict, state, outs, source: str) -> dict:
    """One cell: the train step's own ratio and clip metrics at lr 0, and the spreads of the
    per-token and per-sequence log-ratios from `train_pass_logprobs` (`fns`: `_compiled`)."""
    import jax
    import jax.numpy as jnp

    from gspo_jax.trainer import loop

    r = fns["recompute" if source == "recompute" else "sampler"]
    dev, clip, clip_range, d_BT, m_BT = [], [], [], [], []
    for out in outs:
        if source == "whole_batch":
            out = _with_whole_batch_logprobs(trainer, state, out)
        b = out.batch
        if source == "recompute":  # π_old is this very pass: d = 0 without running it
            d_BT.append(np.zeros(b["response_mask"].shape))
        else:
            logp_BT = np.asarray(fns["pass"](state.train.params, b), np.float64)
            d_BT.append(logp_BT - np.asarray(b["sampler_logprobs"], np.float64))
        m_BT.append(np.asarray(b["response_mask"], np.float64))
        fresh = state.replace(train=jax.tree.map(jnp.copy, state.train))
        _, m = loop.train_on(r, fresh, out)
        m = jax.device_get({k: v for k, v in m.items() if k.startswith("updates/")})
        dev.append(max(np.max(m["updates/ratio_max"]) - 1, 1 - np.min(m["updates/ratio_min"])))
        clip.append(np.mean(m["updates/clipfrac_seq"]))
        clip_range.append(np.mean(m["updates/clipfrac_seq_range"]))
    return {
        "rollouts": len(outs),
        "max_abs_s_minus_1": float(max(dev)),
        "clipfrac_seq": float(np.mean(clip)),
        "clipfrac_seq_range": float(np.mean(clip_range)),
        **gap_stats(np.concatenate(d_BT), np.concatenate(m_BT)),
    }


def train_pass_logprobs(step_config, params, batch: dict):
    """log π_train [B, T] of every response token as the train step's updates compute it:
    its π_old pass (`old_policy_pass`, the loss's own forward on the same strided
    micro-batches), merged back to the batch's row order."""
    from gspo_jax.algorithm import old_policy
    from gspo_jax.sharding.split import num_micro, strided_merge, strided_split
    from gspo_jax.train_step import response_logprobs, shared_group

    parts = step_config.num_mini_batches
    minis = {
        k: strided_split(batch[k], parts) for k in ("tokens", "attention_mask", "response_mask")
    }
    micro = num_micro(step_config.micro_batch_size, minis["tokens"].shape[1])
    group = shared_group(step_config, parts * micro)

    def micro_logprobs(p, mb):
        t = mb["response_mask"].shape[1]
        logp_BT, _, routing = response_logprobs(
            step_config, p, mb["tokens"], mb["attention_mask"], t, group=group
        )
        return logp_BT, routing

    out = old_policy.old_policy_pass(step_config, params, minis, micro_logprobs, micro)
    return strided_merge(out["old_logprobs"])


def gap_stats(d_BT: np.ndarray, mask_BT: np.ndarray) -> dict:
    """Spreads of the log-ratio d [B, T] (log π_train − log π_old per token) over the valid
    tokens (mask [B, T] of 1/0; rows without a valid token are left out):

      log s_i = Σ_t m d / Σ_t m          GSPO's log sequence ratio (paper §4.1)
      log_s_mean, log_s_std              mean and std over sequences of log s_i (ddof 0):
                                         a shared offset that averaging cannot remove,
                                         and the spread it can
      token_gap_std, token_gap_abs_mean  std and mean |d| over all valid tokens
      std_ratio                          log_s_std / token_gap_std (1/sqrt(L) for
                                         independent token gaps; NaN when no gap)
      pass_max_abs_s_minus_1             max |exp(log s_i) − 1| of this pass
      length_mean, length_min, rows      valid tokens per sequence; sequences counted
    """
    lengths_B = mask_BT.sum(axis=1)
    keep = lengths_B > 0
    d_BT, mask_BT, lengths_B = d_BT[keep], mask_BT[keep], lengths_B[keep]
    log_s_B = (d_BT * mask_BT).sum(axis=1) / lengths_B
    tokens = d_BT[mask_BT > 0]
    token_std = float(np.std(tokens))
    log_s_std = float(np.std(log_s_B))
    return {
        "rows": int(keep.sum()),
        "length_mean": float(lengths_B.mean()),
        "length_min": int(lengths_B.min()),
        "log_s_mean": float(np.mean(log_s_B)),
        "log_s_std": log_s_std,
        "token_gap_std": token_std,
        "token_gap_abs_mean": float(np.mean(np.abs(tokens))),
        "std_ratio": log_s_std / token_std if token_std > 0 else float("nan"),
        "pass_max_abs_s_minus_1": float(np.max(np.abs(np.expm1(log_s_B)))),
    }


# --------------------------------------------------------------------------- the report

_SHOWN = ("sampler", "whole_batch", "recompute")  # the table's order within a dtype


def render(rows: Sequence[dict], eps: tuple[float, float]) -> str:
    """The "§5.4 against length" section: noise_length_template.md with the table (grouped by
    dtype and π_old, lengths ascending) and the paragraph that reads it (`finding`)."""
    import string

    rows = sorted(
        rows, key=lambda r: (DTYPES.index(r["dtype"]), _SHOWN.index(r["pi_old"]), r["length"])
    )
    path = os.path.join(os.path.dirname(__file__), "noise_length_template.md")
    with open(path, encoding="utf-8") as f:
        template = string.Template(f.read())
    rollouts = min(r["rollouts"] for r in rows)
    return template.substitute(
        lengths=", ".join(str(n) for n in sorted({r["length"] for r in rows})),
        rows_per_cell=min(r["rows"] for r in rows),
        rollouts=f"{rollouts} rollout" + ("s" if rollouts > 1 else ""),
        pass_agreement=_pass_agreement(rows),
        rows="\n".join(table_row(r) for r in rows),
        finding=finding(rows, eps),
    )


def _pass_agreement(rows: Sequence[dict]) -> str:
    """The clause saying how far the pass's max abs(s_i − 1) is from the train step's in the
    sampler and whole_batch cells ("" without any): the largest gap where the updates
    recompute the pass exactly (the recompute row of that length and dtype is 0), and each
    cell where they do not."""
    exact = {(r["dtype"], r["length"]) for r in rows if r["pi_old"] == "recompute"}
    exact = {k for k in exact if _recompute_max(rows, *k) == 0}
    gaps = {}
    for r in rows:
        if r["pi_old"] != "recompute":
            key = (r["dtype"], r["length"])
            gap = abs(r["pass_max_abs_s_minus_1"] - r["max_abs_s_minus_1"])
            gaps[key] = max(gaps.get(key, 0.0), gap)
    if not gaps:
        return ""
    inside = [g for k, g in gaps.items() if k in exact]
    text = f"{max(inside):.0e}" if inside else ""
    others = [
        f"{d} at L = {n}: {g:.0e}" for (d, n), g in sorted(gaps.items()) if (d, n) not in exact
    ]
    if others:
        text += (", except " if text else "") + "; ".join(others)
        text += " (the updates do not recompute the pass exactly there)"
    return (
        "; in the sampler and whole_batch cells the max abs(s_i − 1) of these log-probs "
        f"differs from the train step's by at most {text}"
    )


def _recompute_max(rows: Sequence[dict], dtype: str, length: int) -> float:
    return next(
        r["max_abs_s_minus_1"]
        for r in rows
        if (r["pi_old"], r["dtype"], r["length"]) == ("recompute", dtype, length)
    )


def table_row(r: dict) -> str:
    """One markdown row of the table (the template's columns); recompute's log-ratio columns
    are "–" (its π_old is the pass itself: d_t = 0 by construction)."""
    ratio = r["std_ratio"]
    ratio = "–" if np.isnan(ratio) else f"{ratio:.3f}"
    own = r["pi_old"] == "recompute"
    cells = [
        str(r["length"]),
        f"{r['length_mean']:.1f}",
        r["dtype"],
        r["pi_old"],
        f"{r['max_abs_s_minus_1']:.1e}",
        f"{r['clipfrac_seq']:.1%}",
        f"{r['clipfrac_seq_range']:.1%}",
        *(
            ["–"] * 4
            if own
            else [
                f"{r['log_s_mean']:.1e}",
                f"{r['log_s_std']:.1e}",
                f"{r['token_gap_std']:.1e}",
                f"{ratio} ({1 / np.sqrt(r['length']):.3f})",
            ]
        ),
        "–" if own else f"{r['token_gap_abs_mean']:.1e}",
    ]
    return "| " + " | ".join(cells) + " |"


def finding(rows: Sequence[dict], eps: tuple[float, float]) -> str:
    """The paragraph under the table, every statement computed from `rows`: at which length,
    if any, the bf16 sampler floor falls below ε_low; how the spread of log s_i scales with L
    (the fitted exponent: −0.5 for independent token gaps) and the offset no length removes;
    a differently shaped trainer pass (whole_batch); f32 as the control; recompute."""
    lo = eps[0]
    parts = []
    bf16 = _series(rows, "bfloat16", "sampler")
    if bf16:
        parts += [_floor_sentence(bf16, lo), _scaling_sentence(bf16, lo)]
    whole, sampler = _series(rows, "bfloat16", "whole_batch"), bf16
    if whole and sampler and whole[-1]["length"] == sampler[-1]["length"]:
        w, s = whole[-1]["max_abs_s_minus_1"], sampler[-1]["max_abs_s_minus_1"]
        same = 1 / 3 <= w / s <= 3 if s > 0 else False
        parts.append(
            f"A second trainer pass with other shapes (whole_batch) gives max abs(s_i − 1) = "
            f"{w:.1e} at L = {whole[-1]['length']} in bf16"
            + (
                ", the same order as the sampler's: the floor is bf16 rounding between any "
                "two differently computed passes, not the inference engine's alone."
                if same
                else f" (the sampler's: {s:.1e})."
            )
        )
    f32 = _series(rows, "float32", "sampler")
    if f32:
        worst = max(r["max_abs_s_minus_1"] for r in f32)
        clip = max(r["clipfrac_seq"] for r in f32)
        below = f" ({lo / worst:.0f}x below ε_low)" if worst > 0 else ""
        clipped = "clips no response" if clip == 0 else f"clips up to {clip:.1%} of responses"
        parts.append(
            f"In f32, the control, the sampler's max abs(s_i − 1) is at most {worst:.1e}"
            f"{below} and {clipped} at any length."
        )
    recompute = [r for r in rows if r["pi_old"] == "recompute"]
    if recompute:
        parts.append(_recompute_sentence(recompute))
    return " ".join(parts)


def _recompute_sentence(rows: list[dict]) -> str:
    """Where π_old recomputed by the train step gives s_i = 1 exactly, and where not."""
    exact = [r for r in rows if r["max_abs_s_minus_1"] == 0]
    dtypes = " and ".join(sorted({r["dtype"] for r in rows}))
    if len(exact) == len(rows):
        return (
            f"π_old recomputed by the train step gives s_i = 1 exactly (nothing clipped) in "
            f"{dtypes} at every length."
        )
    off = "; ".join(
        f"{r['dtype']} at L = {r['length']}: max abs(s_i − 1) = {r['max_abs_s_minus_1']:.1e}, "
        f"{r['clipfrac_seq']:.1%} of the responses clipped"
        for r in rows
        if r["max_abs_s_minus_1"] != 0
    )
    by_dtype = {d: [str(r["length"]) for r in exact if r["dtype"] == d] for d in DTYPES}
    where = "; ".join(f"{d} at L = {', '.join(n)}" for d, n in by_dtype.items() if n)
    where = where or "no cell"
    return (
        f"π_old recomputed by the train step is not exact everywhere: s_i = 1 exactly in "
        f"{where}, but not in {off}."
    )


def _series(rows: Sequence[dict], dtype: str, source: str) -> list[dict]:
    return sorted(
        (r for r in rows if r["dtype"] == dtype and r["pi_old"] == source),
        key=lambda r: r["length"],
    )


def _floor_sentence(series: list[dict], eps: float) -> str:
    """Where the bf16 sampler's max abs(s_i − 1) first falls to ε_low or below, if anywhere."""
    first, last = series[0], series[-1]
    dev = "max abs(s_i − 1)"
    trend = (
        f"{dev} goes from {first['max_abs_s_minus_1']:.1e} at L = {first['length']} to "
        f"{last['max_abs_s_minus_1']:.1e} at L = {last['length']}"
        if len(series) > 1
        else f"{dev} = {last['max_abs_s_minus_1']:.1e} at L = {last['length']}"
    )
    below = [r for r in series if r["max_abs_s_minus_1"] <= eps]
    if not below:
        return (
            f"In bf16 the sampler's floor stays above ε_low = {eps:g} at every length "
            f"measured: {trend} ({last['max_abs_s_minus_1'] / eps:.1f}x ε_low), and a "
            f"parameter-free update still clips {last['clipfrac_seq']:.1%} of the responses "
            f"at L = {last['length']} ({last['clipfrac_seq_range']:.1%} out of range)."
        )
    hit = below[0]
    above = [r["length"] for r in series if r["length"] > hit["length"] and r not in below]
    tail = f", though not at L = {', '.join(map(str, above))}" if above else ""
    return (
        f"In bf16 the sampler's floor falls to ε_low = {eps:g} or below from L = "
        f"{hit['length']} on ({hit['max_abs_s_minus_1']:.1e}, {hit['clipfrac_seq']:.1%} of "
        f"responses clipped){tail}: {trend}."
    )


def _scaling_sentence(series: list[dict], eps: float) -> str:
    """How the spread of log s_i scales with L (least-squares exponents of it and of its
    ratio to the per-token gap's std), how the per-token gap itself changes, the mean
    offset; with a shrinking spread, the length at which 3 std of log s_i would fit inside
    ε_low (an extrapolation, said to be one)."""
    first, last = series[0], series[-1]
    spread = [r for r in series if r["log_s_std"] > 0]
    if len(spread) < 2:
        return ""
    slope = _exponent(spread, "log_s_std")
    gap = last["token_gap_std"] / first["token_gap_std"]
    change = "keeps its size" if 0.9 <= gap <= 1.1 else ("grows" if gap > 1 else "shrinks")
    averaging = _exponent(spread, "std_ratio")
    verdict = (
        "works as for independent token gaps"
        if -0.6 <= averaging <= -0.4
        else ("is weaker than" if averaging > -0.4 else "is stronger than")
        + " for independent token gaps"
    )
    text = (
        f"Averaging {verdict}: std(log s_i) / std(d_t) falls as "
        f"L^{averaging:.2f} (1/√L: L^-0.50; {last['std_ratio']:.3f} against "
        f"{1 / np.sqrt(last['length']):.3f} at L = {last['length']}), but the per-token gap "
        f"{change} with length (std {first['token_gap_std']:.1e} at L = {first['length']}, "
        f"{last['token_gap_std']:.1e} at L = {last['length']}), so the spread of log s_i "
        f"falls as L^{slope:.2f}; the offset shared by all responses, mean log s_i, is "
        f"{last['log_s_mean']:.1e} at L = {last['length']} "
        f"({abs(last['log_s_mean']) / eps:.2f} ε_low), which no length averages away."
    )
    need = 3 * last["log_s_std"]
    if need > eps and slope < -0.1 and abs(last["log_s_mean"]) < eps:
        at = float(f"{last['length'] * (eps / need) ** (1 / slope):.2g}")
        text += (
            f" Extrapolating L^{slope:.2f} (not measured), 3 std of log s_i would fit inside "
            f"ε_low from L ≈ {at:,.0f} on."
        )
    return text


def _exponent(rows: list[dict], key: str) -> float:
    """b of the least-squares fit log(row[key]) = a + b·log(L)."""
    lengths = np.log([r["length"] for r in rows])
    return float(np.polyfit(lengths, np.log([r[key] for r in rows]), 1)[0])
