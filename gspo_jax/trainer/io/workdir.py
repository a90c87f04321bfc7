"""The workdir: checked once at start-up, and the record of the config a run was started with.

  prepare(workdir, checkpoint_dir)       a directory (made if missing) whose checkpoint
                                         directory every process can write
  record_config(config, workdir, ...)    config.json on a fresh run; on a resumed one, the
                                         new config compared with the run's (below)
  lock(workdir) -> RunLock               one run per workdir (WORKDIR/run.lock, below)

A run is its workdir: restarting the same command resumes it from its latest checkpoint.
Restarting it with a different config must not quietly continue (or finish) the old run
under a record that now describes another one, so a resumed run's config is compared with
the config the run was started with (config.json, plus the changes accepted since,
config_changes.jsonl):

- fields in FREE_ON_RESUME may change: they do not change what is computed (logging,
  evaluation, checkpoint cadence, paths whose content is checked elsewhere, the mesh, the
  remat / MoE / attention kernels, and num_steps unless the learning-rate schedule depends
  on it); the change is logged and recorded. So are fields that gspo_jax added or removed
  since the run started (absent from one of the two configs);
- any other difference stops the run before anything is loaded, with a message listing
  every difference; `allow_change=True` (main's --allow_config_change) resumes anyway and
  records the differences with the step they took effect at.

config.json is written once, when the run starts (no checkpoint yet), and never rewritten.

One run per workdir: two runs on one workdir would write every metrics row twice and the
same checkpoints, and the config check above cannot see a run that has no checkpoint yet.
Process 0 takes an exclusive `fcntl.flock` on WORKDIR/run.lock for the whole run (one lock
per run, not per process) and writes the holder into it (pid, host, start time, command);
a second run fails at once naming that holder. The kernel drops a flock when its process
dies however it dies (kill -9, a crash), so a lock left by a dead process never blocks: the
next run takes it and says whose it was. On a shared filesystem (NFS v4, Lustre, GCSFuse
excepted) flock is a lock between hosts too; where the filesystem has no locks at all
(`ENOLCK` / `EOPNOTSUPP`), the holder's record decides: a live pid on this host refuses, a
dead one is taken over, and a record from another host refuses, naming the file to delete
once that run is known to be over (its pid cannot be checked from here).
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import logging
import os
import socket
import sys

import jax

from gspo_jax import jsonio
from gspo_jax import sharding as sharding_lib
from gspo_jax.config import specs
from gspo_jax.trainer.io import disk

log = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
CHANGES_FILE = "config_changes.jsonl"
LOCK_FILE = "run.lock"

# Dotted fields (or prefixes ending in ".") that may differ between a run and its restart.
FREE_ON_RESUME = (
    "num_steps",  # an extension; not free with optim.schedule="cosine" (see `_is_free`)
    "log.",
    "eval.",
    "checkpoint.every_steps",
    "checkpoint.max_to_keep",
    "checkpoint.async_save",
    "checkpoint.save_timeout_s",
    "checkpoint.export_hf",
    "reward.num_workers",
    "reward.timeout_s",
    "reward.max_failed_rollouts",
    "max_all_skipped_steps",  # when to give up on a run whose every update is skipped
    "data.data_dir",  # the prepared data's content is checked by the iterator's fingerprint
    "data.manual_dir",  # and by the manual files' digests (data/build.py)
    "data.download",  # where a Hub dataset may come from, not what it holds
    "warm_start.cache",  # whether a warm start is reused: a resume runs none
    "warm_start.cache_dir",
    "mesh.",  # same math; float sums may round differently on another mesh
    "model.remat",  # kernels and memory only: the same math (float rounding aside)
    "model.moe_impl",
    "model.attention_impl",
    "model.scan_layers",
    "sampling.rollout_mesh.",  # where the rollout runs: the same samples (float rounding aside)
    "sampling.rollout_layout",
)


class WorkdirError(RuntimeError):
    """The workdir cannot hold this run (not a directory, not writable, another config)."""


def prepare(workdir: str, checkpoint_dir: str) -> None:
    """Make `workdir` and `checkpoint_dir` if missing; raise WorkdirError naming the path if
    either is not a directory or the checkpoint directory cannot be written. Every process
    probes (each writes its own checkpoint files) and all agree on the outcome."""
    problem = None
    for named, path in (
        (_named(workdir), workdir),
        (f"the checkpoint directory {checkpoint_dir}", checkpoint_dir),
    ):
        if os.path.exists(path) and not os.path.isdir(path):
            problem = f"{named} is a file, not a directory"
            break
    if problem is None:
        probe = os.path.join(checkpoint_dir, f".write_probe.{jax.process_index()}.{os.getpid()}")
        try:
            os.makedirs(checkpoint_dir, exist_ok=True)
            with open(probe, "w") as f:
                f.write("ok")
            os.remove(probe)
        except OSError as e:
            problem = f"cannot write the checkpoint directory {checkpoint_dir}: {e.strerror or e}"
    if sharding_lib.host_max(problem is not None):
        raise WorkdirError(problem or "another process cannot write the workdir (see its log)")


def check_not_shortened(num_steps: int, steps: list[int], checkpoint_dir: str) -> None:
    """A restart may extend a run, never go back below the RL step it reached: the loop
    would train nothing and export the later checkpoint's model as the run's final one
    (before anything is written, so the refused restart leaves no record)."""
    if steps and num_steps < max(steps):
        raise WorkdirError(
            f"config.num_steps={num_steps} is below the {max(steps)} RL steps this workdir's "
            f"run reached (checkpoint {max(steps)} in {checkpoint_dir}): a run is never "
            f"shortened after the fact. Use num_steps >= {max(steps)}, or a new {workdir_flag()} "
            "for a shorter run"
        )


class RunLock:
    """The workdir's run lock, held by process 0 from `lock` until `release` (a no-op on
    the other processes, and when called again)."""

    def __init__(self, path: str, fd: int | None):
        self.path, self._fd = path, fd

    def release(self) -> None:
        """Empty the record, then unlock (a file left non-empty means: not released). The
        file itself stays: removing it would let a run that opened it just before lock a
        file no longer in the directory, beside a third run that made a new one."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            os.ftruncate(fd, 0)
        except OSError as e:  # a full or vanished filesystem must not hide the run's error
            log.debug("emptying %s: %s", self.path, e)
        finally:
            os.close(fd)  # closing the last descriptor drops the flock


def lock(workdir: str) -> RunLock:
    """Take WORKDIR/run.lock for this run (process 0; module docstring). Raises
    WorkdirError naming the holder when another run holds it; every process agrees."""
    path = os.path.join(workdir, LOCK_FILE)
    problem, fd = None, None
    if jax.process_index() == 0:
        try:
            fd = _take(path)
        except WorkdirError as e:
            problem = str(e)
        except OSError as e:
            problem = f"cannot take the workdir lock {path}: {e.strerror or e}"
    if sharding_lib.host_max(problem is not None):
        if fd is not None:
            RunLock(path, fd).release()
        raise WorkdirError(problem or "process 0 could not lock the workdir (see its log)")
    return RunLock(path, fd)


def _take(path: str) -> int:
    """The locked descriptor of `path` with this process's record written in it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            locks = True
        except OSError as e:
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise WorkdirError(_in_use(path, _holder(fd))) from None
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                raise
            locks = False  # no locks on this filesystem: the record decides (docstring)
        previous = _holder(fd)  # read under the lock: a released lock's record is empty
        if previous:
            _take_over(path, previous, locks)
        record = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "command": " ".join(sys.argv),
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
        return fd
    except BaseException:
        os.close(fd)
        raise


def _take_over(path: str, previous: dict, locks: bool) -> None:
    """Log the takeover of a record a run left behind, or refuse (no locks, holder alive
    or on another host)."""
    same_host = previous.get("host") == socket.gethostname()
    alive = same_host and _alive(previous.get("pid"))
    if not locks and (alive or not same_host):
        where = "" if same_host else " (its pid cannot be checked from this host)"
        raise WorkdirError(
            _in_use(path, previous) + f"{where}; this filesystem has no file locks: once that "
            f"run is known to be over, delete {path}"
        )
    state = "still running but not holding the lock" if alive else "no longer running"
    log.warning(
        "%s: taking over the lock of a run that ended without releasing it: %s (%s)",
        path,
        _describe(previous),
        state if same_host else "on another host",
    )


def workdir_flag() -> str:
    """How the user named the workdir: main's `--workdir` flag, or the variable of the
    script that called it (launch/local.sh sets GSPO_WORKDIR_FLAG="WORKDIR=")."""
    return os.environ.get("GSPO_WORKDIR_FLAG", "--workdir")


def _named(workdir: str) -> str:
    """`--workdir DIR`, or `WORKDIR=DIR` when a script named it so."""
    flag = workdir_flag()
    return f"{flag}{workdir}" if flag.endswith("=") else f"{flag} {workdir}"


def _in_use(path: str, holder: dict | None) -> str:
    workdir = os.path.dirname(path)
    return (
        f"{_named(workdir)} is in use by another run: "
        f"{_describe(holder) if holder else 'its holder is not recorded yet'}. Two runs on "
        "one workdir would write the same checkpoints and metrics: wait for that run to end "
        f"or stop it, or use another {workdir_flag()} (lock file: {path})"
    )


def _describe(holder: dict) -> str:
    return (
        f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')}, started "
        f"{holder.get('started', '?')}"
        + (f" ({holder['command']})" if holder.get("command") else "")
    )


def _holder(fd: int) -> dict | None:
    """The record in the lock file (None when empty: released, or not written yet)."""
    text = os.pread(fd, 1 << 16, 0).decode(errors="replace").strip()
    if not text:
        return None
    try:
        holder = json.loads(text)
    except ValueError:
        return {"pid": "?", "host": "?", "started": f"? (unreadable record {text[:80]!r})"}
    return holder if isinstance(holder, dict) else None


def _alive(pid) -> bool:
    try:
        os.kill(int(pid), 0)
    except (TypeError, ValueError, ProcessLookupError):
        return False
    except PermissionError:  # another user's process
        return True
    return True


def record_config(config, workdir: str, *, resuming: bool, allow_change: bool) -> dict:
    """Write config.json for a fresh run; compare a resumed run's config with its record.

    Returns {field: (recorded, new)} of the differences accepted (empty for a fresh run or
    an unchanged one). Raises WorkdirError listing the differences that change the run,
    unless `allow_change`.
    """
    path = os.path.join(workdir, CONFIG_FILE)
    if not resuming or not os.path.exists(path):
        if resuming:
            log.warning("%s is missing: the resumed run's config cannot be checked", path)
        _write_lead(path, config.to_json_best_effort(indent=2) + "\n")
        return {}
    diffs, changing = config_differences(config, workdir)
    if not diffs:
        return {}
    if changing and not allow_change:
        listing = "; ".join(f"{k}: {old!r} -> {now!r}" for k, (old, now) in changing.items())
        raise WorkdirError(
            f"{workdir} holds a run started with another config, and {len(changing)} "
            f"field(s) that change the run differ: {listing}. Resume with the recorded values "
            f"({path}), start a new {workdir_flag()}, or pass --allow_config_change "
            "(loop.run(..., allow_config_change=True)) to continue this run's checkpoint "
            "under the new config"
        )
    for k, (old, now) in diffs.items():
        kind = "changes the run (allowed by --allow_config_change)" if k in changing else "free"
        log.warning("config.%s: %r -> %r on resume (%s)", k, old, now, kind)
    row = {
        "time": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "changes": {k: list(v) for k, v in diffs.items()},
        "run_changing": sorted(changing),
        "config": json.loads(config.to_json_best_effort()),
    }
    changes = os.path.join(workdir, CHANGES_FILE)
    previous = ""
    if os.path.exists(changes):
        with open(changes) as f:
            previous = f.read()
        previous = previous[: previous.rfind("\n") + 1]  # a torn last row (warned) goes
    _write_lead(changes, previous + json.dumps(row) + "\n")
    return diffs


def config_differences(config, workdir: str) -> tuple[dict, dict]:
    """({field: (recorded, new)} of every difference between `config` and the run recorded
    in `workdir`, the subset of them that change the run (not free on resume))."""
    new = _flatten(json.loads(config.to_json_best_effort()))
    recorded = _recorded(workdir)
    diffs = {
        k: (recorded.get(k, "<absent>"), new.get(k, "<absent>"))
        for k in sorted(set(recorded) | set(new))
        if _norm(k, recorded.get(k), recorded) != _norm(k, new.get(k), new)
    }
    changing = {k: v for k, v in diffs.items() if not _is_free(k, v, recorded, new)}
    return diffs, changing


def _recorded(workdir: str) -> dict:
    """The run's current config: config.json, or the last accepted change's full config."""
    path = os.path.join(workdir, CONFIG_FILE)
    try:
        config = jsonio.read_json(path, what="the run's config record")
    except jsonio.JsonFileError as e:
        raise WorkdirError(
            f"{e}. It records the config this workdir's run started with (a crash or a full "
            f"disk may have torn it): restore it, or delete {path} to resume without the "
            "check (it is then rewritten from this run's config, with a warning)"
        ) from None
    changes = os.path.join(workdir, CHANGES_FILE)
    if os.path.exists(changes):
        # Appended to on each accepted change: a torn last row is skipped with a warning.
        rows = jsonio.read_jsonl(changes, what="a config change", torn_tail="skip")
        for line_no, row in reversed(rows):
            if not isinstance(row.get("config"), dict):
                raise WorkdirError(
                    f"{changes}:{line_no}: a config change without its full 'config': "
                    f"restore the file, or delete it to compare with {path} alone"
                )
            config = row["config"]
            break
    return _flatten(config)


def _is_free(key: str, diff, recorded: dict, new: dict) -> bool:
    if "<absent>" in diff:
        # A field gspo_jax added (or removed) since the run started: config files cannot add
        # fields, so this is an upgrade of the code, not a change the user asked for. Logged
        # and recorded like a free change; refusing it would strand every run in progress.
        return True
    if key == "num_steps":
        # The cosine schedule decays over num_steps: changing it changes every later rate.
        return "cosine" not in (recorded.get("optim.schedule"), new.get("optim.schedule"))
    return any(key == f or (f.endswith(".") and key.startswith(f)) for f in FREE_ON_RESUME)


def _norm(key: str, value, flat: dict):
    """A field's value as the run uses it: equal values are the same setting."""
    if key == "reward_norm":
        return specs.normalize_reward_norm(value)
    if key == "packing" and isinstance(flat.get("response_length"), int):
        # None is the same setting as the bool it resolves to (a run made before None
        # became the default recorded False).
        return specs.resolve_packing(value, flat["response_length"])
    return value


def flat_config(config) -> dict:
    """A ConfigDict as {dotted field: JSON value}, config.json's fields (W&B's run config)."""
    return _flatten(json.loads(config.to_json_best_effort()))


def _flatten(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _write_lead(path: str, text: str) -> None:
    """Process 0 writes `path` atomically (a reader sees the old file or the new one); a
    full disk is one line naming it (disk.py), before the run trains anything."""
    if jax.process_index() != 0:
        return
    lost = "the record of this run's config (nothing has trained yet)"
    disk.write_text(path, text, lost=lost)
