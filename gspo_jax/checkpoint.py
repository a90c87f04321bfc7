"""Orbax checkpoints of a whole RL run, so a killed run resumes as if never stopped.

One checkpoint per saved RL step holds two items:
  state: the jitted train state (params, optimizer state, update count) plus the host-side
         arrays the loop carries: the RNG key data and the running reward moments;
  meta:  JSON: the RL step, the data iterator position, and the config it was written with.

Resume order (train.py follows it, automatically):
  1. the workdir's latest complete checkpoint (orbax only lists committed steps);
  2. otherwise the config's initial Hugging Face checkpoint (config.model.hf_path);
  3. otherwise initialisation from scratch with config.seed.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import orbax.checkpoint as ocp

STATE = "state"
META = "meta"


def make_manager(
    directory: str, *, max_to_keep: int = 3, async_save: bool = True
) -> ocp.CheckpointManager:
    """A CheckpointManager for `directory` (created if missing) keeping the last N steps."""
    options = ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep,
        enable_async_checkpointing=async_save,
        create=True,
    )
    return ocp.CheckpointManager(
        os.path.abspath(directory), options=options, item_names=(STATE, META)
    )


def save(manager: ocp.CheckpointManager, step: int, state: Any, meta: dict) -> None:
    """Start saving `state` (a pytree of jax arrays) and `meta` (JSON-able) at `step`.

    Asynchronous when the manager is: the call returns once device buffers are copied, and
    `manager.wait_until_finished()` blocks until the files are committed.
    """
    manager.save(
        step,
        args=ocp.args.Composite(
            **{STATE: ocp.args.StandardSave(state), META: ocp.args.JsonSave(meta)}
        ),
    )


def abstract_like(tree: Any) -> Any:
    """ShapeDtypeStructs carrying each leaf's sharding: the restore target of `tree`."""
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
        tree,
    )


def restore_latest(manager: ocp.CheckpointManager, abstract_state: Any):
    """Restore the latest checkpoint into `abstract_state`'s shapes and shardings.

    Returns (step, state, meta), or None when the directory holds no complete checkpoint.
    """
    step = manager.latest_step()
    if step is None:
        return None
    restored = manager.restore(
        step,
        args=ocp.args.Composite(
            **{
                STATE: ocp.args.StandardRestore(abstract_state),
                META: ocp.args.JsonRestore(),
            }
        ),
    )
    return step, restored[STATE], restored[META]
