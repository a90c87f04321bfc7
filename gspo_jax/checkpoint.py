"""Orbax checkpoints of a whole RL run, so a killed run resumes as if never stopped.

One checkpoint per saved RL step holds the `RunState` (state.py) as two items:
  state: its arrays: the train state (params, optimizer state, update count), the RNG key
         data, the running reward moments, π_ref's params when there is a KL term;
  meta:  JSON: its host fields: the RL step, the prompt iterator's position (one global
         position, the same on every process: `sharding.process_rows`), and where the params
         came from.

Neither item depends on the number of processes or the mesh: a checkpoint written by 2
processes x 4 devices restores onto 1 process x 8 devices with another mesh (orbax reshards
the arrays into the new `RunState` shardings) and the run continues with the same prompts.
Checkpoints written before the data position was global hold a per-process list: a list of
one (one process, whose order was the global one) resumes; a longer one is refused with a
message, its positions index per-process shuffles that no longer exist.

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
    as JSON `meta`.

    Asynchronous when the manager is: the call returns once device buffers are copied, and
    `manager.wait_until_finished()` blocks until the files are committed.
    """
    meta = state.meta()
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
    if isinstance(meta["data"], list):  # the format before global batches: one per process
        if len(meta["data"]) > 1:
            raise ValueError(
                f"checkpoint {step} in {manager.directory} holds one data position per process "
                f"({len(meta['data'])} of them): it was written before prompt batches became "
                "global, and this version cannot continue its per-process prompt order. "
                "Resume it with the version that wrote it, on the same number of processes."
            )
        meta["data"] = meta["data"][0]  # one process: its order was the global one
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
