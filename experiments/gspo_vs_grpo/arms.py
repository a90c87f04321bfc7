"""The experiment's arms and budget: which config each arm runs, and how one seed of it is
set up (equal rollout budgets, checkpoints, evaluation, the shared warm start)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

EPS_GSPO = (3e-4, 4e-4)  # configs/gspo_paper.py
UPCYCLE_NOISE = 0.01  # relative per-weight noise that lets the upcycled experts diverge
PAPER_EXPERT_CHANGE = 0.10  # §5.3: ~10% of activated experts change per update (48 layers)


@dataclasses.dataclass(frozen=True)
class Arm:
    model: str  # "moe" | "dense"
    name: str  # "gspo" | "grpo_rr" | "grpo"
    label: str
    config_fn: Callable

    @property
    def key(self) -> str:
        return f"{self.model}/{self.name}"


def _moe(arg):
    from configs import moe_tiny

    return lambda: moe_tiny.get_config(arg)


def _dense(algo):
    def make():
        from configs import grpo_paper, gspo_paper

        return {"gspo": gspo_paper, "grpo": grpo_paper}[algo].get_config()

    return make


ARMS: tuple[Arm, ...] = (
    Arm("moe", "gspo", "GSPO (MoE)", _moe("algo=gspo")),
    Arm("moe", "grpo_rr", "GRPO + Routing Replay (MoE)", _moe("algo=grpo,routing_replay=true")),
    Arm("moe", "grpo", "GRPO (MoE)", _moe("algo=grpo")),
    Arm("dense", "gspo", "GSPO (dense)", _dense("gspo")),
    Arm("dense", "grpo", "GRPO (dense)", _dense("grpo")),
)


@dataclasses.dataclass(frozen=True)
class Budget:
    steps: int  # RL steps per run (every arm: steps x prompts x G responses)
    seeds: int
    prompts: int  # prompts per rollout (G = 8 responses each, the default config's)
    eval_every: int
    eval_prompts: int
    quick: bool = False  # shrink batch, warm start and evaluation: a smoke test, no result
    independent_warm_starts: bool = False  # seed k's runs start from a warm start of seed k
    moe_seeds: int | None = None  # seeds of the MoE arms (None: `seeds`)

    def seeds_of(self, arm: Arm) -> list[int]:
        """The seeds the arm runs: 0 .. n-1 (the MoE arms may run fewer)."""
        n = self.seeds if arm.model != "moe" or self.moe_seeds is None else self.moe_seeds
        return list(range(n))


def arm_config(arm: Arm, seed: int, budget: Budget, root: str, warm: str | None = None):
    """The arm's config for one seed under the budget (data generated once under root),
    starting from the warm-started checkpoint `warm` (None: the config's own warm start)."""
    c = arm.config_fn()
    c.data.data_dir = os.path.join(root, "data")
    c.seed = seed
    # Its own 1200 steps, not the default run's warm start trained to a target accuracy:
    # with --independent_warm_starts the warm start is a factor the seeds vary (and these
    # are the warm starts docs/results.md was made from).
    c.warm_start.target_accuracy = None
    c.num_steps = budget.steps
    c.rollout_batch_size = budget.prompts
    c.eval.every_steps = budget.eval_every
    c.eval.num_prompts = budget.eval_prompts
    c.eval.batch_size = min(c.eval.batch_size, budget.eval_prompts)
    c.checkpoint.every_steps = 0  # checkpoint 0 (the warm start) and the last step only
    c.checkpoint.async_save = False
    c.log.progress_bar = False
    c.reward.num_workers = 0  # the exact-sum verifier is cheap: score in-process
    c.eval.save_per_problem = True  # per-problem correctness: the paired bootstrap's unit
    assert c.num_mini_batches == 4, arm.key
    if budget.quick:
        c.num_return_sequences_in_group = 4
        c.warm_start.steps, c.warm_start.batch_size = 3, 16
        c.response_length = 12
    if warm is not None:
        c.model.hf_path = warm  # its config.json, weights and tokenizer
        c.warm_start.steps = 0
        if arm.model == "moe":  # upcycled experts are the dense MLP's width (192): running
            c.model.moe_impl = "ragged"  # only the chosen 2 is ~2.5x faster here, and exact
    return c


def run_dir(root: str, arm: Arm, seed: int) -> str:
    """Where one run of the arm lives: <root>/<model>_<arm>/seed<k>/."""
    return os.path.join(root, f"{arm.model}_{arm.name}", f"seed{seed}")
