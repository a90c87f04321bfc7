"""How a metric computed on one micro-batch becomes the metric of a mini-batch, of an
optimizer update, and of an RL step: declared where the metric is produced.

The train step evaluates the loss micro-batch by micro-batch, and runs several optimizer
updates per RL step. Each metric says how it combines:

    over micro-batches (`micro`)   sum          the parts add up (losses with global
                                                denominators, counts)
                                   min / max    the extreme over the micro-batches (over
                                                those holding a valid token)
                                   token_mean   a mean over valid tokens: weighted by each
                                                micro-batch's valid tokens
                                   seq_mean     a mean over valid sequences: weighted by each
                                                micro-batch's valid sequences
                                   None: not a micro-batch metric (computed once per
                                   update, e.g. the gradient norm)
    over updates (`updates`)       mean (default), sum, min, max
    per update (`per_update`)      also reported as `updates/<name>` [U], one value per
                                   update (update 0 is on-policy: its ratios sit at the noise
                                   floor)

A metric without a declaration is an error when the train step is traced, never a silent
token mean. Producers keep their declarations in a dict next to the code that computes the
values (`objectives.policy_metric_reductions`, the train step's own).
"""

from __future__ import annotations

import dataclasses

MICRO_KINDS = ("sum", "min", "max", "token_mean", "seq_mean")
UPDATE_KINDS = ("mean", "sum", "min", "max")


@dataclasses.dataclass(frozen=True)
class Reduction:
    micro: str | None
    updates: str = "mean"
    per_update: bool = False

    def __post_init__(self):
        if self.micro is not None and self.micro not in MICRO_KINDS:
            raise ValueError(f"Reduction.micro={self.micro!r} is not one of {MICRO_KINDS}")
        if self.updates not in UPDATE_KINDS:
            raise ValueError(f"Reduction.updates={self.updates!r} is not one of {UPDATE_KINDS}")

    def logged(self) -> Reduction:
        """The same, also reported per update."""
        return dataclasses.replace(self, per_update=True)


SUM = Reduction("sum")
MIN = Reduction("min", updates="min")
MAX = Reduction("max", updates="max")
TOKEN_MEAN = Reduction("token_mean")
SEQ_MEAN = Reduction("seq_mean")
PER_UPDATE = Reduction(None)  # one value per update, averaged over the updates


def reduction_of(name: str, declared: dict[str, Reduction]) -> Reduction:
    """The declared reduction of metric `name`; KeyError naming it when there is none."""
    try:
        return declared[name]
    except KeyError:
        raise KeyError(
            f"metric {name!r} has no declared reduction (gspo_jax.algorithm.reductions): declare how it "
            "combines over micro-batches and updates where it is produced"
        ) from None
