"""Orbax checkpoints of a whole RL run, so a killed run resumes as if never stopped.

One checkpoint per saved RL step holds the `RunState` (state.py) as two items:
  state: its arrays: the train state (params, optimizer state, update count), the RNG key
         data, the running reward moments, π_ref's params when there is a KL term;
  meta:  JSON: its host fields: the RL step, the prompt iterator's position (one global
         position, the same on every process: `sharding.process_rows`), where the params
         came from, and a checksum of every array (`digests`).

Neither item depends on the number of processes or the mesh: a checkpoint written by 2
processes x 4 devices restores onto 1 process x 8 devices with another mesh (orbax reshards
the arrays into the new `RunState` shardings) and the run continues with the same prompts.
Checkpoints written before the data position was global hold a per-process list: a list of
one (one process, whose order was the global one) resumes; a longer one is refused with a
message, its positions index per-process shuffles that no longer exist.

Resume order (trainer/loop.py follows it, automatically):
  1. the workdir's newest usable checkpoint (orbax only lists committed steps; a step whose
     arrays do not match their checksums, or that cannot be read at all, is moved aside to
     `<step>.corrupt` with a warning naming it, and the next older one is tried);
  2. otherwise the config's initial Hugging Face checkpoint (config.model.hf_path);
  3. otherwise initialisation from scratch with config.seed.

Integrity: orbax 0.12.8 checksums only the shard index of its zarr3 arrays, not the data,
so a flipped byte in a data file restores silently. `digests` fixes that: two 32-bit sums
per array, Σ w_i·(2i+1) and Σ (w_i ⊕ φ·i)·c over its bits w as uint32 words (i the linear
index, φ and c odd constants), computed on the device by one jitted reduction, so sharded
arrays are never gathered. Any single flipped bit changes both sums (an odd multiple of
2^k is never 0 mod 2^32), and integer sums are exact in any order: the digest does not
depend on the sharding or the device count. Saved in `meta`, recomputed after a restore.

Failures surface, never hang: directories are created synchronously (orbax's asynchronous
creation, when it fails, leaves commit threads waiting five minutes for a signal that never
comes, and the interpreter waits for them at exit), a failed save raises `CheckpointError`
at the next `check` / `save` / `finish`, naming the directory and the cause (a full disk:
`OSError: [Errno 28] No space left on device`). A save that never ends (a filesystem that
stops answering) is bounded by `save_timeout_s` (config.checkpoint.save_timeout_s): `save`
and `finish` wait at most that long, `check` raises once a background write has run longer,
and from then on nothing waits for that manager again (`close` included), so the run ends
with its error instead of joining a thread stuck in a write. Orbax's own reports of a failed
background write are held back (orbax_logs.py): the one line is the CheckpointError. A save that
fails or stalls leaves the checkpoints committed before it as they were (orbax writes into
`<step>.orbax-checkpoint-tmp` and renames it only once complete).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from gspo_jax import models
from gspo_jax import sharding as sharding_lib
from gspo_jax.models import lora
from gspo_jax.trainer.io import disk, orbax_logs
from gspo_jax.trainer.state import RunState

log = logging.getLogger(__name__)

STATE = "state"
META = "meta"
CORRUPT_SUFFIX = ".corrupt"


# The default bound of one save (config.checkpoint.save_timeout_s; configs/base.py).
DEFAULT_SAVE_TIMEOUT_S = 1800.0


class CheckpointError(RuntimeError):
    """A checkpoint could not be written, or none of the workdir's could be restored."""


@dataclasses.dataclass
class _Saves:
    """A manager's bound on saves and what is known of its latest one."""

    timeout_s: float
    step: int | None = None  # the latest save's step
    started: float | None = None  # time.monotonic() when its background write began
    stuck: str | None = None  # why nothing may wait for this manager again (a stall)


def _saves(manager) -> _Saves:
    saves = getattr(manager, "gspo_jax_saves", None)
    if saves is None:  # a manager made elsewhere: the default bound
        saves = _Saves(DEFAULT_SAVE_TIMEOUT_S)
        manager.gspo_jax_saves = saves
    return saves


def make_manager(
    directory: str,
    *,
    max_to_keep: int = 3,
    async_save: bool = True,
    save_timeout_s: float = DEFAULT_SAVE_TIMEOUT_S,
) -> ocp.CheckpointManager:
    """A CheckpointManager for `directory` (created if missing) keeping the last N steps;
    each of its saves may take `save_timeout_s` seconds (module docstring)."""
    options = ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep,
        enable_async_checkpointing=async_save,
        create=True,
        # A failed asynchronous mkdir leaves orbax's commit threads waiting (module docstring).
        async_options=ocp.AsyncOptions(create_directories_asynchronously=False),
    )
    manager = ocp.CheckpointManager(
        os.path.abspath(directory),
        options=options,
        item_handlers={STATE: ocp.StandardCheckpointHandler(), META: ocp.JsonCheckpointHandler()},
    )
    manager.gspo_jax_saves = _Saves(float(save_timeout_s))
    if async_save:
        orbax_logs.OrbaxErrorsToDebug.directories.add(str(manager.directory))
        orbax_logs.hold_back_background_failures()  # a failed background write: one line, not 240
    return manager


def save(manager: ocp.CheckpointManager, state: RunState) -> None:
    """Start saving `state` at its RL step: its arrays as the `state` item, its host fields
    as JSON `meta` (the arrays' digests added).

    Asynchronous when the manager is: the call returns once device buffers are copied, and
    `finish(manager)` blocks until the files are committed. Raises CheckpointError if this
    save, or an earlier asynchronous one, failed, or if it does not return within the
    manager's save timeout (orbax first waits for the previous save to be committed).
    """
    arrays = state.arrays()
    meta = state.meta()
    meta["digests"] = {path: list(d[:2]) for path, d in digests(arrays).items()}
    args = ocp.args.Composite(
        **{STATE: ocp.args.StandardSave(arrays), META: ocp.args.JsonSave(meta)}
    )
    what = f"saving checkpoint {state.step}"
    with _failure_as_error(manager, what):
        _bounded(manager, what, lambda: manager.save(state.step, args=args))
    saves = _saves(manager)
    saves.step, saves.started = state.step, time.monotonic()


def check(manager: ocp.CheckpointManager) -> None:
    """Raise CheckpointError now if an asynchronous save has failed, or has been writing for
    longer than the save timeout (cheap; every step). A failure on one process raises on
    all (one tiny all-gather), so none is left waiting."""
    error = None
    try:
        saves = _saves(manager)
        age = time.monotonic() - saves.started if saves.started is not None else 0.0
        with _failure_as_error(manager, "an asynchronous checkpoint save"):
            # Orbax's check waits for its metadata writes, under a lock a stuck write holds:
            # bounded by what is left of the save's time (the run's hang on a full disk).
            _bounded(
                manager,
                f"saving checkpoint {saves.step}",
                manager.check_for_errors,
                timeout_s=max(saves.timeout_s - age, 0.5),
            )
        overdue = saves.started is not None and age > saves.timeout_s
        if overdue and manager.is_saving_in_progress():
            raise _stalled(manager, f"saving checkpoint {saves.step}", saves)
    except CheckpointError as e:
        error = e
    if sharding_lib.host_max(error is not None):
        raise error or CheckpointError(
            f"an asynchronous checkpoint save in {manager.directory} failed on another "
            "process (see its log)"
        )


def finish(manager: ocp.CheckpointManager) -> None:
    """Block until every save is committed (at most the save timeout); CheckpointError if
    one failed or did not end in time."""
    saves = _saves(manager)
    what = (
        "committing a checkpoint" if saves.step is None else f"committing checkpoint {saves.step}"
    )
    with _failure_as_error(manager, what):
        _bounded(manager, what, manager.wait_until_finished)


def close(manager: ocp.CheckpointManager) -> None:
    """`manager.close()` (which waits for a save in flight) within the save timeout; nothing
    at all once a save has stalled: its thread is stuck in a write that will not return."""
    if _saves(manager).stuck:
        log.debug("not closing %s: %s", manager.directory, _saves(manager).stuck)
        return
    with _failure_as_error(manager, "closing the checkpoint manager"):
        _bounded(manager, "closing the checkpoint manager", manager.close)


def _bounded(manager, what: str, fn, *, timeout_s: float | None = None):
    """fn() on a helper thread, waited for at most `timeout_s` (default: the manager's save
    timeout; a write that never returns cannot be interrupted, only left behind): its
    result, or its exception, or a CheckpointError when it outlives the wait or an earlier
    save already did."""
    saves = _saves(manager)
    if saves.stuck:
        raise CheckpointError(f"{what} in {manager.directory}: not tried, {saves.stuck}")
    outcome: dict = {}
    done = threading.Event()

    def target():
        try:
            outcome["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
            outcome["error"] = e
        finally:
            done.set()

    # A daemon thread: one stuck in a write must not keep the process alive at exit.
    threading.Thread(target=target, name=f"gspo_jax: {what}", daemon=True).start()
    if not done.wait(saves.timeout_s if timeout_s is None else timeout_s):
        raise _stalled(manager, what, saves)
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("value")


def _stalled(manager, what: str, saves: _Saves) -> CheckpointError:
    """The error of a save that outlived the timeout; marks the manager stuck."""
    saves.stuck = f"an earlier save did not finish within {saves.timeout_s:g} s"
    orbax_logs.keep_filters_to_the_end()
    return CheckpointError(
        f"{what} in {manager.directory} did not finish within {saves.timeout_s:g} s "
        "(config.checkpoint.save_timeout_s): the filesystem stopped answering, or is far "
        "slower than this save needs; the checkpoints committed before it are intact"
    )


@contextlib.contextmanager
def _failure_as_error(manager, what: str):
    try:
        yield
    except CheckpointError:
        orbax_logs.keep_filters_to_the_end()
        raise
    except Exception as e:
        orbax_logs.keep_filters_to_the_end()
        raise CheckpointError(f"{what} in {manager.directory} failed: {_cause(e)}") from e


def _cause(error: BaseException) -> str:
    """The innermost error of a chain, on one line. A chain can be a cycle (seen closing
    the manager after a save failed on a full disk: an error whose context leads back to
    itself): the walk stops before an error it has already seen."""
    seen = {id(error)}
    while True:
        inner = error.__cause__
        if inner is None and not error.__suppress_context__:
            inner = error.__context__
        if inner is None or id(inner) in seen:
            break
        seen.add(id(inner))
        error = inner
    text = " ".join(str(error).split())
    code = _OS_ERROR_CODE.search(text)
    if code and not isinstance(error, OSError):
        # Tensorstore reports a failed write as a ValueError of several hundred characters
        # ending in the OS error's code: name it as the OSError it is, and its file.
        errno_ = int(code.group(1))
        where = _TENSORSTORE_FILE.search(text)
        where = f" (writing {where.group(1)})" if where else ""
        return f"OSError: [Errno {errno_}] {os.strerror(errno_)}{where}"
    return f"{type(error).__name__}: {text[:400]}"


_OS_ERROR_CODE = re.compile(r"\[os_error_code='?(\d+)'?\]")
_TENSORSTORE_FILE = re.compile(r'Failed writing: "([^"]+)"')


# ------------------------------------------------------------------------------ restore


def restore_latest(manager: ocp.CheckpointManager, abstract: RunState) -> RunState | None:
    """The newest usable checkpoint restored into `abstract`'s shapes and shardings, or
    None when the directory holds none.

    A step that cannot be read or whose arrays fail their digests is moved aside
    (`<step>.corrupt`) with a warning, and the next older one is tried; CheckpointError if
    none is usable. A checkpoint whose arrays have other shapes than `abstract` (the model
    changed) is an error naming the first differences, not a fallback: every step of the
    run has the same shapes.
    """
    ours = set(existing_steps(str(manager.directory), warn=False))  # setup warned
    steps = sorted((s for s in manager.all_steps() if s in ours), reverse=True)
    if not steps:
        return None
    failures = []
    for step in steps:
        reason = _restore_step(manager, step, abstract)
        if isinstance(reason, RunState):
            if failures:
                log.warning(
                    "resuming from checkpoint %d: the newer %s unusable (moved aside to %s)",
                    step,
                    " and ".join(f"{s}" for s, _ in failures)
                    + (" is" if len(failures) == 1 else " are"),
                    ", ".join(_path(manager, s) + CORRUPT_SUFFIX for s, _ in failures),
                )
            return reason
        log.warning("checkpoint %s is unusable: %s", _path(manager, step), reason)
        failures.append((step, reason))
        _move_aside(manager, step)
    listing = "; ".join(f"step {s}: {r}" for s, r in failures)
    raise CheckpointError(
        f"no usable checkpoint in {manager.directory} (each moved aside to "
        f"<step>{CORRUPT_SUFFIX}): {listing}"
    )


def _restore_step(manager, step: int, abstract: RunState) -> RunState | str:
    """The restored state, or why step `step` is unusable. Every process reaches the same
    verdict (a failure on one is agreed over all before anything else is collective)."""
    args = ocp.args.Composite(
        **{STATE: ocp.args.StandardRestore(abstract.arrays()), META: ocp.args.JsonRestore()}
    )
    error = mismatch = None
    try:
        # Reading the metadata of a damaged step fails the same noisy way as the restore.
        with orbax_logs.quiet_failures() as quiet:
            mismatch = _shape_mismatch(manager, step, abstract, quiet)
            if mismatch is None:
                restored = manager.restore(step, args=args)
                arrays, meta = dict(restored[STATE]), dict(restored[META])
    except Exception as e:  # noqa: BLE001 - any unreadable file: try the previous step
        error = f"cannot be read ({_cause(e)})"
    if mismatch:
        raise CheckpointError(
            f"checkpoint {_path(manager, step)} does not fit this run's state: {mismatch}. "
            "The model or the KL setting changed since it was written: resume with the "
            "original config, or start a new --workdir"
        )
    if sharding_lib.host_max(error is not None):
        return error or "cannot be read on another process (see its log)"
    bad = _verify(arrays, meta.get("digests"))
    if bad:
        return bad
    if isinstance(meta.get("data"), list):  # the format before global batches: per process
        if len(meta["data"]) > 1:
            raise ValueError(
                f"checkpoint {_path(manager, step)} holds one data position per process "
                f"({len(meta['data'])} of them): it was written before prompt batches became "
                "global, and this version cannot continue its per-process prompt order. "
                "Resume it with the version that wrote it, on the same number of processes."
            )
        meta["data"] = meta["data"][0]  # one process: its order was the global one
    meta["origin"] = f"checkpoint {step} in {manager.directory}"
    return abstract.restored(arrays, meta)


def _verify(arrays: dict, saved: dict | None) -> str | None:
    """Why `arrays` differ from the digests saved with them (None when they agree)."""
    got = digests(arrays)
    nonfinite = [path for path, d in got.items() if not d[2]]
    if saved is None:
        log.warning("checkpoint has no array digests (written by an older gspo_jax): unchecked")
    else:
        wrong = [p for p, d in got.items() if list(d[:2]) != list(saved.get(p, ()))]
        if wrong:
            return (
                f"{len(wrong)} array(s) differ from the digests saved with them, e.g. "
                f"{wrong[0]} (the files were changed or damaged after the save)"
            )
    if nonfinite:
        return f"{len(nonfinite)} array(s) hold NaN or inf, e.g. {nonfinite[0]}"
    return None


def _shape_mismatch(manager, step: int, abstract: RunState, quiet) -> str | None:
    """The first differences between the saved arrays' shapes and `abstract`'s, or None
    (also when the metadata cannot be read: the restore will say why; `quiet`, the
    `orbax_logs.quiet_failures` around both, is told)."""
    try:
        saved = manager.item_metadata(step)[STATE]
        saved = {
            _key(path): tuple(m.shape)
            for path, m in jax.tree_util.tree_flatten_with_path(
                getattr(saved, "tree", saved), is_leaf=lambda x: hasattr(x, "shape")
            )[0]
        }
    except Exception:  # noqa: BLE001 - unreadable metadata is corruption, not a mismatch
        quiet.failed = True
        return None
    wanted = {
        _key(path): tuple(a.shape)
        for path, a in jax.tree_util.tree_flatten_with_path(abstract.arrays())[0]
    }
    diffs = [f"{k} is missing" for k in wanted if k not in saved]
    diffs += [f"{k} is not in this run" for k in saved if k not in wanted]
    diffs += [f"{k} saved {saved[k]} vs now {v}" for k, v in wanted.items() if saved.get(k, v) != v]
    if not diffs:
        return None
    more = f" (and {len(diffs) - 3} more)" if len(diffs) > 3 else ""
    return "; ".join(diffs[:3]) + more


def _key(path) -> str:
    """A tree path as "train/params/embed/embedding", whatever the container types."""
    parts = []
    for entry in path:
        for attr in ("key", "name", "idx"):
            if hasattr(entry, attr):
                parts.append(str(getattr(entry, attr)))
                break
    return "/".join(parts)


def _path(manager, step: int) -> str:
    return os.path.join(str(manager.directory), str(step))


def _move_aside(manager, step: int) -> None:
    """Rename step `step` to `<step>.corrupt` (kept for inspection; orbax no longer lists
    it, so later saves and restarts do not trip over it). Process 0 renames; all wait."""
    if jax.process_index() == 0:
        path = _path(manager, step)
        target = path + CORRUPT_SUFFIX
        n = 1
        while os.path.exists(target):
            target, n = f"{path}{CORRUPT_SUFFIX}.{n}", n + 1
        os.rename(path, target)
    sharding_lib.barrier(f"checkpoint_move_aside_{step}")
    manager.reload()


# ------------------------------------------------------------------------------ digests


def _words(x: jax.Array) -> jax.Array:
    """The bits of `x` as uint32 (2-byte and 1-byte types widened, 8-byte ones split)."""
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    size = x.dtype.itemsize
    if size == 4:
        return jax.lax.bitcast_convert_type(x, jnp.uint32)
    if size == 2:
        return jax.lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32)
    if size == 1:
        return jax.lax.bitcast_convert_type(x, jnp.uint8).astype(jnp.uint32)
    return jax.lax.bitcast_convert_type(x, jnp.uint32)  # [..., size // 4]


def _digest(x: jax.Array):
    """(Σ w_i·(2i+1), Σ (w_i ⊕ φ·i)·c, all finite) of one array (module docstring)."""
    w = _words(x)
    index = jnp.zeros(w.shape, jnp.uint32)
    stride = 1
    for axis in reversed(range(w.ndim)):  # the linear index, without reshaping (sharding)
        index = index + jax.lax.broadcasted_iota(jnp.uint32, w.shape, axis) * np.uint32(stride)
        stride = (stride * w.shape[axis]) % 2**32
    first = jnp.sum(w * (index * np.uint32(2) + np.uint32(1)), dtype=jnp.uint32)
    second = jnp.sum(
        (w ^ (index * np.uint32(0x9E3779B9))) * np.uint32(0x85EBCA6B), dtype=jnp.uint32
    )
    finite = jnp.all(jnp.isfinite(x)) if jnp.issubdtype(x.dtype, jnp.inexact) else jnp.bool_(True)
    return first, second, finite


_digests_jit = jax.jit(lambda tree: jax.tree.map(_digest, tree))


def digests(tree) -> dict[str, tuple[int, int, bool]]:
    """{path: (sum 1, sum 2, all finite)} of every array of `tree` (one jitted reduction;
    the same values on every process and for every sharding)."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    out = jax.device_get(_digests_jit([leaf for _, leaf in leaves]))
    return {_key(path): (int(a), int(b), bool(f)) for (path, _), (a, b, f) in zip(leaves, out)}


def require_finite(tree, what: str) -> None:
    """Raise ValueError naming the first arrays of `tree` that hold NaN or inf."""
    bad = [path for path, d in digests(tree).items() if not d[2]]
    if bad:
        more = f" (and {len(bad) - 3} more)" if len(bad) > 3 else ""
        raise ValueError(f"{what} holds NaN or inf in {', '.join(bad[:3])}{more}")


# ------------------------------------------------------------------------------ export


def export_hf(model_config, tokenizer, params, path: str) -> str:
    """The policy as a Hugging Face checkpoint directory (safetensors + tokenizer) at `path`.

    Refuses params holding NaN or inf (a run must never leave a NaN model behind). Every
    process gathers the params; process 0 writes (`_export_to`: a crash or a full disk
    mid-export leaves the previous export whole)."""
    require_finite(params, f"the final policy (not exported to {path})")
    params = sharding_lib.gather_params(params)
    path = os.path.normpath(path)
    if jax.process_index() == 0:
        with _export_to(path, "the final policy's export") as partial:
            models.save_pretrained(model_config, params, partial)
            if tokenizer is not None:
                tokenizer.save_pretrained(partial)
    return path


def export_peft(model_config, params, path: str, *, base_model: str = "") -> str:
    """LoRA's adapters alone at `path`, in PEFT's layout (`lora.save_peft`). Every process
    takes part in gathering them; process 0 writes (`_export_to`)."""
    adapters = sharding_lib.gather_params(lora.trainable(params))
    require_finite(adapters, f"the final LoRA adapters (not exported to {path})")
    path = os.path.normpath(path)
    if jax.process_index() == 0:
        with _export_to(path, "the LoRA adapters' export") as partial:
            lora.save_peft(model_config, adapters, partial, base_model=base_model)
    return path


@contextlib.contextmanager
def _export_to(path: str, what: str):
    """Yields `path`.partial to write into, which then takes `path`'s place: another
    model's files left there (pytorch_model.bin, vocab.json, ... which a loader may pick
    before ours) are removed and named in a warning. A full disk is one line naming `path`
    (disk.py), the partial folder removed and the previous export kept."""
    partial = path + ".partial"
    disk.remove(partial)  # a crashed export's leftovers
    kept = "the checkpoints are kept" + (", and the previous export" * os.path.isdir(path))
    with disk.writing(path, what, kept, partial=partial):
        yield partial
    if os.path.isdir(path):
        stale = sorted(set(os.listdir(path)) - set(os.listdir(partial)))
        if stale:
            log.warning(
                "%s held files the export does not write (another model's?), removed: %s",
                path,
                ", ".join(stale),
            )
    disk.remove(path)
    os.replace(partial, path)


def save_params(path: str, params) -> None:
    """A params tree saved once at `path` (orbax, sharded; LoRA's warm-started base)."""
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(os.path.abspath(path), params, force=True)
        ckptr.wait_until_finished()


def restore_params(path: str, abstract_params, shardings):
    """`save_params`' tree, restored straight into `shardings`."""
    if not os.path.isdir(path):
        raise CheckpointError(
            f"{path} is missing: a LoRA run that warm-started its base saves it there, and "
            "resuming needs it (the checkpoints hold the adapters only)"
        )
    target = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract_params, shardings
    )
    with ocp.StandardCheckpointer() as ckptr:
        return ckptr.restore(os.path.abspath(path), target)


# What a step directory of ours holds (orbax's metadata and commit marker, our two items): a
# directory named like a step that holds none of them was not written by the run.
_STEP_FILES = ("_CHECKPOINT_METADATA", "commit_success.txt", STATE, META)


def existing_steps(directory: str, *, warn: bool = True) -> list[int]:
    """The checkpoint steps under `directory` (a cheap listing, no orbax).

    Entries the run did not write are ignored, named in one warning (`warn`): a file or
    a directory named like a step without a checkpoint's files (a copy made by hand, an
    empty folder) used to count as a step reached, refusing a resume with the run's own
    num_steps, and orbax would try it first and move it aside as damaged. Orbax's own
    temporary folders and our `<step>.corrupt` are not foreign."""
    if not os.path.isdir(directory):
        return []
    steps, foreign = [], []
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if name.isdigit() and os.path.isdir(path) and not os.path.islink(path):
            if any(os.path.exists(os.path.join(path, f)) for f in _STEP_FILES):
                steps.append(int(name))
                continue
        elif name.endswith(CORRUPT_SUFFIX) or ".orbax-checkpoint-tmp" in name:
            continue
        foreign.append(name)
    if foreign and warn:
        log.warning(
            "%s holds entries this run did not write, ignored: %s (move them elsewhere: "
            "a folder named like a step would be taken for one by orbax)",
            directory,
            ", ".join(foreign),
        )
    return sorted(steps)


# The run's end puts back what the orbax log handling changed (Trainer.close).
release_process_hooks = orbax_logs.release_process_hooks
