"""The experiment's arms and budget: which config each arm runs, and how one seed of it is
set up (equal rollout budgets, checkpoints, evaluation, the shared warm start)."""

from __future__ import annotations

import dataclasses
import difflib
import os
from collections.abc import Callable

EPS_GSPO = (3e-4, 4e-4)  # configs/gspo_paper.py
UPCYCLE_NOISE = 0.01  # relative per-weight noise that lets the upcycled experts diverge
PAPER_EXPERT_CHANGE = 0.10  # §5.3: ~10% of activated experts change per update (48 layers)
DEV_PROBLEMS = 500  # --dev: the first 500 train problems are the dev split


@dataclasses.dataclass(frozen=True)
class MoETestBed:
    """How the MoE arms' model is made from seed k's dense warm start (`run.warm_start`):
    upcycled to `num_experts` experts, `top_k` active, each weight of each expert the dense
    MLP's times (1 + noise·N(0, 1)), a random router; then `specialise_steps` supervised
    steps of the MoE itself (router and experts), so the experts differ by training, not by
    the noise alone (0: the experts stay noisy copies)."""

    name: str
    num_experts: int
    top_k: int
    noise: float
    specialise_steps: int
    # (config field, value) pairs of the dense model the MoE is upcycled from, set on its
    # warm start (so the dense arms of such a run are that model too); () for the default
    # task's 3-layer model.
    dense_model: tuple[tuple[str, object], ...] = ()
    router_aux_loss_coef: float = 0.0  # the load-balancing loss, in specialisation and RL

    def describe(self, steps: int | None = None) -> str:
        """In words; `steps`: the specialisation steps that ran (default: the bed's)."""
        steps = self.specialise_steps if steps is None else steps
        shape = ", ".join(f"{k.removeprefix('model.')} {v}" for k, v in self.dense_model)
        made = (
            f"{self.num_experts} experts, top-{self.top_k}, every expert a copy of the dense "
            f"MLP times 1 + {self.noise:g}·N(0, 1) per weight, and a random router"
        )
        if shape:
            made += f" (the dense warm start's {shape})"
        if self.router_aux_loss_coef:
            made += f"; a load-balancing loss ({self.router_aux_loss_coef:g}) in every step"
        if not steps:
            return made + "; the experts stay copies"
        return (
            made + f", then {steps} supervised steps of the MoE itself on the warm start's "
            "demonstrations, router and experts trained, so that the experts specialise"
        )


MOE_TESTBEDS = {
    # docs/results_moe.md: the experts differ by 1 % noise only; a routing change then
    # barely changes π (0.4 % of the experts change per update).
    "copied": MoETestBed("copied", 8, 2, UPCYCLE_NOISE, 0),
    # Issue #24's bed for §5.3: >= 16 experts, top-k >= 4, trained. The noise breaks the
    # copies' symmetry enough for the router to tell them apart; training does the rest.
    "specialised": MoETestBed("specialised", 16, 4, 0.1, 600),
    # Issue #43's bed for §5.3 (docs/results_moe_volatility.md's cpu scale): deeper, with
    # load balancing, so that routing has more to change. The GRPO vs GRPO + Routing Replay
    # vs GSPO comparison on it is sized for a GPU (docs/experiments.md).
    "deep": MoETestBed(
        "deep",
        16,
        4,
        0.1,
        400,
        dense_model=(("model.num_layers", 8), ("model.intermediate_size", 128)),
        router_aux_loss_coef=0.01,
    ),
}


@dataclasses.dataclass(frozen=True)
class Arm:
    model: str  # "moe" | "dense"
    name: str  # "gspo" | "grpo_rr" | "grpo"
    label: str
    config_fn: Callable
    # (config field, value) pairs set last, after the budget's settings: a sweep's variant
    # of the arm (sweep.py); () for the arm itself.
    overrides: tuple[tuple[str, object], ...] = ()

    @property
    def variant(self) -> str:
        """The overrides as "field=value,field=value" ("" for the arm itself)."""
        return ",".join(f"{k}={v}" for k, v in self.overrides)

    @property
    def key(self) -> str:
        base = f"{self.model}/{self.name}"
        return f"{base}@{self.variant}" if self.overrides else base


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

# The rest of the GSPO family (docs/objectives.md): each its preset (configs/<name>.py) on
# the same task, seeds, warm starts and budget. Run only when --arms names them, so the
# default experiment (and docs/results.md) stays GSPO vs GRPO.
FAMILY = {"sapo": "SAPO", "cispo": "CISPO", "gmpo": "GMPO", "luspo": "LUSPO", "dppo": "DPPO"}


def _family(name):
    def make():
        import importlib

        return importlib.import_module(f"configs.{name}").get_config()

    return make


FAMILY_ARMS: tuple[Arm, ...] = tuple(
    Arm(model, name, f"{label} ({model.replace('moe', 'MoE')})", fn)
    for model in ("moe", "dense")
    for name, label in FAMILY.items()
    for fn in [_moe(f"algo={name}") if model == "moe" else _family(name)]
)
ALL_ARMS: tuple[Arm, ...] = ARMS + FAMILY_ARMS


@dataclasses.dataclass(frozen=True)
class Budget:
    steps: int  # RL steps per run (every arm: steps x prompts x G responses)
    seeds: int
    prompts: int  # prompts per rollout (G = 8 responses each, the default config's)
    eval_every: int
    eval_prompts: int
    quick: bool = False  # shrink batch, warm start and evaluation: a smoke test, no result
    # Train (warm start and RL) on train[DEV_PROBLEMS:], evaluate on train[:DEV_PROBLEMS]
    # (a dev split for choosing hyperparameters; the test split is never read).
    dev: bool = False
    independent_warm_starts: bool = False  # seed k's runs start from a warm start of seed k
    moe_seeds: int | None = None  # seeds of the MoE arms (None: `seeds`)
    # "add2": configs/default.py's task (16-token answers); "scratchpad": configs/scratchpad.py
    # at `scale` ("cpu": 2-6 digits, 0.8M parameters; "gpu": 4-10 digits, 2.9M), every arm.
    task: str = "add2"
    scale: str = "cpu"
    moe_testbed: str = "specialised"  # MOE_TESTBEDS: how the MoE arms' model is made
    # (config field, value) pairs set on every config of the budget, warm start included,
    # after the task's own settings (the mechanism test's harder task: mechanism.py); a
    # workdir holds one such setting (its warm starts are not told apart by them).
    warm_overrides: tuple[tuple[str, object], ...] = ()

    @property
    def moe(self) -> MoETestBed:
        return MOE_TESTBEDS[self.moe_testbed]

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
    if budget.task == "scratchpad":  # trained to its target accuracy (configs/scratchpad.py)
        from configs import scratchpad

        scratchpad.use_scratchpad(c, budget.scale)
    else:
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
    if budget.dev:
        c.data.train_split = f"train[{DEV_PROBLEMS}:]"
        c.data.eval_split = f"train[:{DEV_PROBLEMS}]"
    for field, value in budget.warm_overrides:
        set_field(c, field, value, "the budget's warm_overrides")
    if warm is None:  # trained from scratch: the dense warm start (the MoE's is upcycled)
        for field, value in budget.moe.dense_model:
            set_field(c, field, value, f"--moe_testbed={budget.moe.name}")
    if arm.model == "moe" and budget.moe.router_aux_loss_coef:
        c.model.router_aux_loss_coef = budget.moe.router_aux_loss_coef
    if budget.quick:
        c.num_return_sequences_in_group = 4
        c.warm_start.steps, c.warm_start.batch_size = 3, 16
        c.warm_start.target_accuracy = None
        if budget.task == "add2":  # the scratchpad's solutions need their length
            c.response_length = 12
    if warm is not None:
        c.model.hf_path = warm  # its config.json, weights and tokenizer
        c.warm_start.steps = 0
        if arm.model == "moe":  # upcycled experts are the dense MLP's width (192). Both
            # implementations are exact; measured here, running only the chosen 2 of 8 is
            # ~2.5x faster than all 8, but all 16 beat the chosen 4 of 16 by ~1.25x.
            c.model.moe_impl = "ragged" if budget.moe.top_k <= 2 else "dense"
    for field, value in arm.overrides:
        set_field(c, field, value, arm.key)
    return c


def _fields(c, prefix: str = "") -> list[str]:
    """Every dotted field of a ConfigDict."""
    out = []
    for key, value in c.items():
        if hasattr(value, "items"):
            out += _fields(value, f"{prefix}{key}.")
        else:
            out.append(f"{prefix}{key}")
    return out


def set_field(c, field: str, value, who: str) -> None:
    """c.<field> = value, cast to the field's type ("1e-4" for a float, "true" for a bool);
    a field the config lacks or a value that does not cast is a ValueError naming both."""
    *parents, leaf = field.split(".")
    node = c
    for name in parents:
        node = node.get(name) if hasattr(node, "get") else None
    if node is None or not hasattr(node, "get") or leaf not in node:
        known = _fields(c)
        near = difflib.get_close_matches(field, known, n=3)
        hint = f"; did you mean {', '.join(near)}?" if near else f" (fields: {', '.join(known)})"
        raise ValueError(f"{who}: the config has no field {field!r}{hint}")
    old = node[leaf]
    try:
        if isinstance(old, bool):
            if str(value).lower() not in ("true", "false"):
                raise ValueError("not true or false")
            value = str(value).lower() == "true"
        elif isinstance(old, (int, float)):
            value = type(old)(float(value) if isinstance(old, float) else int(value))
        elif isinstance(old, str):
            value = str(value)
        elif old is None:  # a placeholder (e.g. micro_batch_size): a number if it reads as one
            value = _literal(str(value))
        node[leaf] = value
    except (TypeError, ValueError) as e:
        raise ValueError(f"{who}: {field}={value!r} does not fit the field ({old!r}): {e}") from e


def run_dir(root: str, arm: Arm, seed: int) -> str:
    """Where one run of the arm lives: <root>/<model>_<arm>/seed<k>/, or a sweep variant's
    <root>/<model>_<arm>/<field>=<value>/seed<k>/."""
    parts = [f"{arm.model}_{arm.name}"] + ([arm.variant] if arm.overrides else [])
    return os.path.join(root, *parts, f"seed{seed}")


def _literal(text: str):
    """ "8" -> 8, "1e-4" -> 1e-4, anything else stays text."""
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text
