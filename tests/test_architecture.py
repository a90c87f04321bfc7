"""The package's wiring, as docs/architecture.md draws it.

- Nothing below setup reads the ConfigDict: once `setup.setup` has returned, any read of a
  ConfigDict field fails, and a whole run (warm start, rollouts, train steps, evaluation,
  checkpoints, the Hugging Face export) still goes through.
- The import graph of gspo_jax has no cycle and runs one way: the paper's math imports only
  itself; models import no stage; the sampler no trainer code; the train step no
  orchestration; nothing imports `main`.
- Every extension point is a `Registry` with a public `register_*`, and a name registered
  after import is valid in a config (validation reads the live registry).
- Importing any module of the package changes no process-global state (environment
  variables, sys hooks, warning filters).
"""

from __future__ import annotations

import ast
import importlib
import os
import subprocess
import sys
import warnings
from pathlib import Path

import jax
import ml_collections
import pytest
from helpers import TINY_MODEL, apply_flags

from configs import default
from gspo_jax.registry import Registry

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "gspo_jax"


def _tiny_config(data_dir):
    c = default.get_config()
    apply_flags(c, TINY_MODEL)
    c.num_steps, c.rollout_batch_size, c.num_return_sequences_in_group = 2, 4, 4
    c.num_mini_batches, c.reward.num_workers = 2, 0
    c.eval.num_prompts = c.eval.batch_size = 8
    c.eval.every_steps = 1
    c.checkpoint.async_save = False
    c.log.tensorboard = False
    c.data.data_dir = str(data_dir)
    return c


def test_nothing_below_setup_reads_the_config(tmp_path, monkeypatch):
    from gspo_jax.trainer import loop, setup

    config = _tiny_config(tmp_path / "data")
    trainer = setup.setup(config, str(tmp_path / "run"))
    try:

        def tripwire(self, name):
            raise AssertionError(f"a ConfigDict was read after setup (field {name!r})")

        # Every field access goes through these (attribute and item syntax, .get).
        for method in ("__getattr__", "__getitem__", "get"):
            monkeypatch.setattr(ml_collections.ConfigDict, method, tripwire)
        with jax.set_mesh(trainer.mesh):
            summary = loop.train(trainer, loop.init_or_restore(trainer))
    finally:
        monkeypatch.undo()
        trainer.close()
    assert summary["eval_end"] >= 0 and os.path.isdir(summary["export"])


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict[str, set[str]]:
    """{module: gspo_jax modules it imports (at any depth of its code)}."""
    graph = {}
    modules = {_module_name(p) for p in PACKAGE.rglob("*.py")}
    for path in PACKAGE.rglob("*.py"):
        name, found = _module_name(path), set()
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                    base = f"{base}.{node.module}" if node.module else base
                for a in node.names:  # `from pkg import module` is an edge to the module
                    sub = f"{base}.{a.name}"
                    found.add(sub if sub in modules else base)
        graph[name] = {m for m in found if m in modules and m != name}
    return graph


def test_the_import_graph_has_no_cycle():
    graph = _imports()
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node):
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycle = path[path.index(nxt) :] + [nxt]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)


# Which stage may import which (by the package path's prefix); the math sits at the bottom.
MATH = ("gspo_jax.algorithm", "gspo_jax.objectives", "gspo_jax.advantages", "gspo_jax.registry")
STAGES = ("gspo_jax.rollout", "gspo_jax.train_step", "gspo_jax.trainer", "gspo_jax.config")
FORBIDDEN = {
    MATH: ("gspo_jax.models", "gspo_jax.sampling", "gspo_jax.data", "gspo_jax.rewards") + STAGES,
    ("gspo_jax.models",): ("gspo_jax.sampling",) + STAGES,
    ("gspo_jax.sampling",): STAGES,
    ("gspo_jax.rollout",): ("gspo_jax.train_step", "gspo_jax.trainer"),
    ("gspo_jax.train_step",): ("gspo_jax.rollout", "gspo_jax.trainer"),
    ("gspo_jax.sharding",): ("gspo_jax.models", "gspo_jax.sampling") + STAGES,
    ("gspo_jax.data", "gspo_jax.rewards"): STAGES,
}
# The public paths of the paper's math (gspo_jax/__init__.py): the modules in algorithm/.
PUBLIC_ALIASES = {
    "gspo_jax.objectives": "gspo_jax.algorithm.objectives",
    "gspo_jax.advantages": "gspo_jax.algorithm.advantages",
}


def test_imports_run_one_way():
    graph = _imports()
    bad = []
    for module, imported in graph.items():
        for sources, forbidden in FORBIDDEN.items():
            if module.startswith(sources):
                bad += [f"{module} -> {m}" for m in imported if m.startswith(forbidden)]
        bad += [f"{module} -> {m}" for m in imported if m == "gspo_jax.main"]
    assert not bad, bad


def test_only_the_orchestration_reads_a_config_file():
    """ml_collections is imported only where the ConfigDict is read: the trainer's
    validation, translation, setup and workdir record, and the entry point."""
    readers = {
        "gspo_jax.main",
        "gspo_jax.config.validate",
        "gspo_jax.config.specs",
        "gspo_jax.trainer.setup",
        "gspo_jax.trainer.io.workdir",
    }
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text()
        if "ml_collections" in text and _module_name(path) not in readers:
            pytest.fail(f"{_module_name(path)} imports ml_collections")


def test_every_extension_point_is_a_registry_with_a_public_register():
    from gspo_jax import advantages, data, objectives
    from gspo_jax.rewards import registry as rewards

    points = [
        (objectives.RATIOS, objectives.register_importance_sampling),
        (objectives.LOSS_AGG_MODES, objectives.register_loss_agg),
        (objectives.LOSS_MODES, objectives.register_loss_mode),
        (objectives.KL_ESTIMATORS, objectives.register_kl_estimator),
        (advantages.ADV_ESTIMATORS, advantages.register_advantage_estimator),
        (rewards.REWARDS, rewards.register_reward),
        (data.DATASETS, data.register_dataset),
    ]
    for registry, register in points:
        assert isinstance(registry, Registry) and len(registry) > 0
        assert not register.__name__.startswith("_")


def test_a_sequence_ratio_registered_later_gets_the_gspo_checks():
    """config.validate reads the live registry: a sequence-level ratio registered after
    import is valid and warned about like GSPO (a GRPO-sized clip range)."""
    from gspo_jax import objectives
    from gspo_jax.config.validate import ConfigWarning, validate

    @objectives.register_importance_sampling("test_seq_late", sequence_level=True)
    def _late(logprobs_BT, old_BT, mask_BT):
        return objectives.seq_log_ratio(logprobs_BT, old_BT, mask_BT)

    try:
        c = default.get_config()
        c.importance_sampling = "test_seq_late"
        c.clip_low, c.clip_high = 0.2, 0.27
        with pytest.warns(ConfigWarning, match="GRPO-sized range"):
            validate(c)
        with pytest.raises(ValueError, match="already registered"):
            objectives.register_importance_sampling("test_seq_late", sequence_level=True)(
                lambda a, b, c: a
            )
    finally:
        objectives.RATIOS.remove("test_seq_late")


def test_an_undeclared_metric_is_an_error_not_a_token_mean():
    from gspo_jax.algorithm.reductions import reduction_of

    with pytest.raises(KeyError, match="no declared reduction"):
        reduction_of("my_new_metric", {})


def test_importing_the_package_changes_no_process_state():
    """Every module imported in a fresh interpreter (after the third-party libraries, which
    set warning filters of their own): the environment, sys hooks and the warning filters
    are as they were."""
    modules = sorted(
        _module_name(p) for p in PACKAGE.rglob("*.py") if _module_name(p) != "gspo_jax.main"
    )
    code = f"""
import os, sys, warnings, importlib
import absl.logging, flax.nnx, grain, jax, matplotlib.pyplot, ml_collections, numpy, optax
import orbax.checkpoint, safetensors, tensorboardX, tensorflow_datasets, tqdm, transformers
env, hooks = dict(os.environ), (sys.excepthook, sys.unraisablehook, sys.stderr, sys.stdout)
filters = list(warnings.filters)
for m in {modules!r}:
    importlib.import_module(m)
assert dict(os.environ) == env, sorted(set(os.environ.items()) ^ set(env.items()))
assert (sys.excepthook, sys.unraisablehook, sys.stderr, sys.stdout) == hooks
new = [f for f in warnings.filters if f not in filters]
assert not new, new
"""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_module_imports_are_importable():
    """Every module imports on its own (a moved file leaves no dangling import)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for path in sorted(PACKAGE.rglob("*.py")):
            name = _module_name(path)
            if name != "gspo_jax.main":
                assert importlib.import_module(name).__name__ == name
    for public, module in PUBLIC_ALIASES.items():
        assert importlib.import_module(public) is importlib.import_module(module)
