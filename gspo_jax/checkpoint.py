"""Orbax checkpoints of a whole RL run, so a killed run resumes as if never stopped.

One checkpoint per saved RL step holds the `RunState` (state.py) as two items:
  state: its arrays: the train state (params, optimizer state, update count), the RNG key
         data, the running reward moments, π_ref's params when there is a KL term;
  meta:  JSON: its host fields: the RL step, every process's data iterator position, and
         where the params came from.

Resume order (train.py follows it, automatically):
  1. the workdir's latest complete checkpoint (orbax only lists committed steps);
  2. otherwise the config's initial Hugging Face checkpoint (config.model.hf_path);
  3. otherwise initialisation from scratch with config.seed.
"""

from __future__ import annotations

import os

import jax
import orbax.checkpoint as ocp

from gspo_jax import models
from gspo_jax import sharding as sharding_lib
from gspo_jax.state import RunState

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


def save(manager: ocp.CheckpointManager, state: RunState) -> None:
    """Start saving `state` at its RL step: its arrays as the `state` item, its host fields
    as JSON `meta`, the data position of every process gathered into one list.

    Asynchronous when the manager is: the call returns once device buffers are copied, and
    `manager.wait_until_finished()` blocks until the files are committed.
    """
    meta = state.meta()
    meta["data"] = sharding_lib.gather_json(state.data)
    manager.save(
        state.step,
        args=ocp.args.Composite(
            **{STATE: ocp.args.StandardSave(state.arrays()), META: ocp.args.JsonSave(meta)}
        ),
    )


def restore_latest(manager: ocp.CheckpointManager, abstract: RunState) -> RunState | None:
    """The latest complete checkpoint restored into `abstract`'s shapes and shardings, or
    None when the directory holds none."""
    step = manager.latest_step()
    if step is None:
        return None
    restored = manager.restore(
        step,
        args=ocp.args.Composite(
            **{STATE: ocp.args.StandardRestore(abstract.arrays()), META: ocp.args.JsonRestore()}
        ),
    )
    meta = dict(restored[META])
    states = meta["data"]
    if len(states) != jax.process_count():
        raise ValueError(
            f"checkpoint {step} was written by {len(states)} processes; resuming it with "
            f"{jax.process_count()} would change every process's data shard"
        )
    meta["data"] = states[jax.process_index()]
    meta["origin"] = f"checkpoint {step} in {manager.directory}"
    return abstract.restored(dict(restored[STATE]), meta)


def export_hf(model_config, tokenizer, params, path: str) -> str:
    """The policy as a Hugging Face checkpoint directory (safetensors + tokenizer) at `path`.

    Every process takes part in gathering the (possibly multi-host) params; process 0
    writes.
    """
    params = sharding_lib.gather_params(params)
    if jax.process_index() == 0:
        models.save_pretrained(model_config, params, path)
        tokenizer.save_pretrained(path)
    return path
