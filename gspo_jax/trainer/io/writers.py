"""Where metrics go: workdir/metrics.jsonl, TensorBoard event files, and a PNG of the curves;
with log.wandb_project, a Weights & Biases run too (wandb_writer.py, a mirror of the rows).

TensorBoard files are written by tensorboardX (protobuf only, no TensorFlow). Only process 0
writes; every call is cheap enough for once per RL step.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
from collections.abc import Mapping, Sequence

import numpy as np

from gspo_jax import jsonio
from gspo_jax.trainer.io import disk

log = logging.getLogger(__name__)

# Panels of the end-of-run plot: (title, metric keys drawn in it). A key ending in "*"
# stands for every key that continues it with a number (the per-update values
# `updates/<key>/<u>`, u = 0, 1, ...; `eval/pass@<j>`);
# a panel with none of its keys in the run (expert change of a dense model) is left out.
PLOT_PANELS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("reward", ("reward/mean",)),
    ("held-out accuracy (greedy)", ("eval/accuracy",)),
    ("held-out pass@k, maj@k (sampled)", ("eval/pass@*", "eval/maj@*")),
    ("clipped fraction (tokens, sequences)", ("policy/clipfrac", "policy/clipfrac_seq")),
    ("clipped fraction of sequences, per update", ("updates/clipfrac_seq/*",)),
    (
        "gradient limited (tokens, sequences), mean weight",  # every loss_mode
        ("policy/limited_frac", "policy/limited_frac_seq", "policy/weight_mean"),
    ),
    ("ratio min / max, per update", ("updates/ratio_min/*", "updates/ratio_max/*")),
    ("expert change rate, per update (MoE)", ("updates/expert_change/*",)),
    (
        "train/inference log-prob gap",
        ("sampler/logprob_gap_mean", "sampler/seq_logprob_gap_max", "policy/ratio_noise_floor"),
    ),
    ("KL", ("policy/approx_kl", "policy/kl_ref")),
    ("entropy", ("policy/entropy",)),
    ("response length", ("response/length_mean",)),
)


def _to_builtin(value):
    if isinstance(value, (np.generic, np.ndarray)):
        value = value.item() if np.ndim(value) == 0 else np.asarray(value).tolist()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/inf; keep them visible as strings
    return value


# Characters TensorBoard refuses in a tag (tensorboardX's rule): they become "_".
_TB_TAG_INVALID = re.compile(r"[^-/\w.]")


def tb_tag(key: str) -> str:
    """The TensorBoard tag of a metric key: eval/pass@2 -> eval/pass_2. Done here, as
    tensorboardX would, so that it does not log a line per key at every evaluation."""
    return _TB_TAG_INVALID.sub("_", key)


class MetricsWriter:
    """Appends one JSON line per call to metrics.jsonl and mirrors scalars to TensorBoard.

    A run resumed from its checkpoint at step k calls `resume(k)` first: the rows an
    interrupted run wrote after step k (they will be written again) are dropped from
    metrics.jsonl, and TensorBoard is told to hide its events after k (purge_step), so
    both hold one row per step however often the run was restarted.

    `mirrors` get every row too (`resume(step)`, `write(step, metrics)`, `preempting()`,
    `close()`): the W&B run (wandb_writer.WandbWriter).
    """

    def __init__(self, workdir: str, *, tensorboard: bool = True, enabled: bool = True, mirrors=()):
        self.enabled = enabled
        self.path = os.path.join(workdir, "metrics.jsonl")
        self._tb_dir = os.path.join(workdir, "tb") if tensorboard else None
        self._tb = None
        self._tb_events: _GuardedEvents | None = None  # the event file's write errors
        self.mirrors = tuple(mirrors) if enabled else ()
        if enabled:
            os.makedirs(workdir, exist_ok=True)

    def resume(self, step: int) -> int:
        """Drop the rows after `step` (all of them at step 0, whose evaluation is redone);
        returns how many were dropped. A torn last line (a kill mid-write) goes too."""
        if not self.enabled:
            return 0
        self._open_tb(purge_step=step + 1 if step else 0)
        for mirror in self.mirrors:
            mirror.resume(step)
        if not os.path.exists(self.path):
            return 0
        with open(self.path) as f:
            lines = f.readlines()
        kept = []
        for line in lines:
            try:
                row_step = json.loads(line)["step"]
            except (ValueError, KeyError, TypeError):
                continue
            if step and row_step <= step:
                kept.append(line if line.endswith("\n") else line + "\n")
        if len(kept) != len(lines):
            lost = f"the rows after step {step} are not dropped yet (nothing trained)"
            disk.write_text(self.path, "".join(kept), lost=lost)
        return len(lines) - len(kept)

    def _open_tb(self, purge_step: int | None = None) -> None:
        if self._tb is None and self._tb_dir is not None:
            from tensorboardX import SummaryWriter

            with disk.writing(self._tb_dir, "TensorBoard's events", "metrics.jsonl is kept"):
                self._tb = SummaryWriter(self._tb_dir, purge_step=purge_step)
            self._tb_events = _GuardedEvents.install(self._tb)

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        if not self.enabled:
            return
        row = {"step": int(step), **{k: _to_builtin(v) for k, v in metrics.items()}}
        self._append(json.dumps(row) + "\n", step)
        self._open_tb()
        if self._tb is not None:
            self._tb_events.check(step)
            for key, value in metrics.items():
                if np.ndim(value) == 0 and np.isfinite(value):
                    self._tb.add_scalar(tb_tag(key), float(value), int(step))
        for mirror in self.mirrors:
            mirror.write(step, metrics)

    def _append(self, line: str, step: int) -> None:
        """One row appended whole: a failed write is cut back off (a full disk's "[Errno 28]
        No space left on device" named no file, and left half a row)."""
        lost = f"step {step}'s row is lost"
        kept = "the rows before it are kept, whole"
        with disk.writing(self.path, lost, kept):
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:  # unbuffered: nothing is left to flush (and half-write) at close
                size = os.lseek(fd, 0, os.SEEK_END)
                data = memoryview(line.encode())
                try:
                    while data:
                        data = data[os.write(fd, data) :]
                except OSError:
                    os.ftruncate(fd, size)  # frees the blocks; the half row never stays
                    raise
            finally:
                os.close(fd)

    def preempting(self) -> None:
        """A signal stops the run: the mirrors mark their runs resumable."""
        for mirror in self.mirrors:
            mirror.preempting()

    def close(self) -> None:
        if self._tb is not None:
            self._tb.flush()
            self._tb.close()
            self._tb = None
            if self._tb_events.error is not None:  # closing never raises: said once
                log.warning("TensorBoard's events were not all written: %s", self._tb_events.error)
        for mirror in self.mirrors:
            mirror.close()


class _GuardedEvents:
    """tensorboardX's event file, its failed writes (a full disk) remembered instead of
    ending its logger thread with a traceback, then blocking `add_scalar` once its queue
    filled. The next `write` raises one `disk.DiskWriteError` naming the events file."""

    def __init__(self, inner):
        self.inner, self.error = inner, None

    @classmethod
    def install(cls, summary_writer) -> _GuardedEvents:
        events = summary_writer._get_file_writer().event_writer  # tensorboardX 2.6 internals
        guard = cls(events._ev_writer)
        events._ev_writer = events._worker._record_writer = guard
        return guard

    def _guarded(self, name: str, *args):
        if self.error is None:
            try:
                return getattr(self.inner, name)(*args)
            except OSError as e:
                self.error = e
        return None

    def write_event(self, event):
        return self._guarded("write_event", event)

    def flush(self):
        return self._guarded("flush")

    def close(self):
        return self._guarded("close")

    def check(self, step: int) -> None:
        if self.error is not None:
            path = self.inner._file_name
            with disk.writing(
                path, f"TensorBoard's events up to step {step}", "metrics.jsonl is kept"
            ):
                raise self.error


def read_metrics(path: str) -> list[dict]:
    """The rows of a metrics.jsonl file (later rows for the same step win on resume)."""
    by_step: dict[int, dict] = {}
    order: list[int] = []
    for line_no, row in jsonio.read_jsonl(path, what="a metrics row", torn_tail="skip"):
        step = row.get("step")
        if not isinstance(step, int):
            raise jsonio.JsonFileError(f"{path}:{line_no}: a metrics row without an integer 'step'")
        if step not in by_step:
            order.append(step)
            by_step[step] = {}
        by_step[step].update(row)
    return [by_step[s] for s in sorted(order)]


def _ema(values: Sequence[float], decay: float) -> list[float]:
    """Bias-corrected exponential moving average (as TensorBoard's smoothing)."""
    out, avg = [], 0.0
    for i, v in enumerate(values, 1):
        avg = decay * avg + (1 - decay) * v
        out.append(avg / (1 - decay**i))
    return out


def _expand(keys: Sequence[str], present: set[str]) -> list[str]:
    """`keys` with each "prefix*" replaced by the present keys "prefix<n>", in n's order."""
    out = []
    for key in keys:
        if not key.endswith("*"):
            out.append(key)
            continue
        prefix = key[:-1]
        found = [k for k in present if k.startswith(prefix) and k[len(prefix) :].isdigit()]
        out += sorted(found, key=lambda k: int(k[len(prefix) :]))
    return out


_STYLES = ("-", "--", ":", "-.")
_RATIOS = {"seq": "s_i per response (GSPO)", "seq_token": "s_i per response (GSPO-token)"}


def ratio_of_run(metrics_path: str) -> str | None:
    """Which ratio the clip panels plot, from the run's config.json beside metrics.jsonl."""
    path = os.path.join(os.path.dirname(metrics_path), "config.json")
    try:
        with open(path) as f:
            mode = json.load(f).get("importance_sampling")
    except (OSError, ValueError, AttributeError):
        return None
    return _RATIOS.get(mode, "r_t per token (GRPO)" if mode == "token" else mode)


def binomial_band(ax, rows, xs, ys, color) -> None:
    """The 95 % Wilson interval of each held-out accuracy over its eval/num_prompts problems."""
    n_by_step = {r["step"]: r.get("eval/num_prompts") for r in rows if "eval/accuracy" in r}
    lo, hi = [], []
    for x, p in zip(xs, ys):
        n = n_by_step.get(x) or 0
        if not n:
            return
        z, centre = 1.96, (p + 1.96**2 / (2 * n)) / (1 + 1.96**2 / n)
        half = z * math.sqrt(p * (1 - p) / n + z**2 / (4 * n * n)) / (1 + z**2 / n)
        lo.append(centre - half)
        hi.append(centre + half)
    ax.fill_between(xs, lo, hi, color=color, alpha=0.2, label="95 % interval (problems)")


def plot_curves(
    metrics_path: str,
    png_path: str,
    panels: Sequence[tuple[str, Sequence[str]]] = PLOT_PANELS,
) -> str:
    """Draw the main training curves of a metrics.jsonl into one PNG; returns its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_path)
    present = set().union(*(r.keys() for r in rows)) if rows else set()
    panels = [
        (title, keys)
        for title, keys in ((t, _expand(k, present)) for t, k in panels)
        if any(k in present for k in keys)
    ]
    cols = 3
    nrows = max(1, math.ceil(len(panels) / cols))
    fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 3.0 * nrows), squeeze=False)
    ratio = ratio_of_run(metrics_path)
    for ax, (title, keys) in zip(axes.flat, panels):
        for i, key in enumerate(keys):
            xs = [r["step"] for r in rows if isinstance(r.get(key), (int, float))]
            ys = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
            if not xs:
                continue
            style = _STYLES[i % len(_STYLES)]  # keys that coincide stay told apart
            if len(xs) < 30:  # sparse (evaluations): every point matters
                (line,) = ax.plot(xs, ys, style, marker=".", label=key)
                if key == "eval/accuracy":
                    binomial_band(ax, rows, xs, ys, line.get_color())
                continue
            # Per-step RL metrics are noisy: raw values faintly, an EMA on top.
            (line,) = ax.plot(xs, ys, alpha=0.25, linewidth=0.8)
            ax.plot(xs, _ema(ys, 0.9), style, color=line.get_color(), label=f"{key} (EMA)")
        if ratio and title.startswith(("clipped fraction", "ratio min")):
            title = f"{title}\nratio: {ratio}"
        ax.set_title(title)
        ax.set_xlabel("RL step")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.tight_layout()
    tmp = f"{png_path}.tmp.png"  # written whole, then renamed: never half a PNG
    with disk.writing(png_path, "the plot of the curves", "metrics.jsonl is kept", partial=tmp):
        fig.savefig(tmp, dpi=110)
        os.replace(tmp, png_path)
    plt.close(fig)
    return png_path
