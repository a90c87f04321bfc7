"""Entry point: flags -> (distributed JAX) -> loop.run(config, workdir).

  python -m gspo_jax.main --config=configs/default.py --workdir=/tmp/run [--config.x=y ...]

The config file is locked: an unknown `--config.foo=` is an error. On a TPU pod every host
runs this same command (launch/tpu_pod.sh); `--distributed` (default: on when the TPU or
cluster environment says there are several processes) calls jax.distributed.initialize().
For multi-process runs on one CPU machine (tests), pass --coordinator, --num_processes and
--process_id explicitly.

How it ends (docs/failures.md):
  0                 the run finished (or was already finished)
  1                 an error: one line on stderr naming the field / file / tensor / value;
                    the traceback in WORKDIR/error.log (--debug prints it instead)
  2                 a config or command-line error, before anything ran
  128 + signal      SIGTERM (143), SIGINT (130), SIGHUP (129), SIGUSR1 (138), SIGUSR2
                    (140), SIGXCPU (152): stopped at a step boundary with a checkpoint;
                    the same command resumes
The process never outlives its result: if threads (orbax, verifier pools) still hold it
SHUTDOWN_GRACE_S after the end, it exits anyway; after a checkpoint error it exits at once
(a write stuck in a filesystem that stopped answering can be neither joined nor killed).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import traceback

from absl import app, flags
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file(
    "config", "configs/default.py", "Experiment config file.", lock_config=True
)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints, metrics, plots.")
_COORDINATOR = flags.DEFINE_string(
    "coordinator", None, "host:port of process 0 (explicit multi-process set-up)."
)
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Number of JAX processes.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's index.")
_DISTRIBUTED = flags.DEFINE_bool(
    "distributed",
    None,
    "Call jax.distributed.initialize() (default: auto-detect a TPU pod / SLURM cluster).",
)
_ALLOW_CONFIG_CHANGE = flags.DEFINE_bool(
    "allow_config_change",
    False,
    "Resume a workdir whose run was started with a config that differs in fields that "
    "change the run (listed and recorded in WORKDIR/config_changes.jsonl).",
)
_DEBUG = flags.DEFINE_bool(
    "debug", False, "On an error, print the full traceback (default: one line)."
)
log = logging.getLogger("gspo_jax.main")

# Seconds the interpreter may take to shut down after main returns before it is ended.
SHUTDOWN_GRACE_S = 30.0
EXIT_ERROR, EXIT_USAGE = 1, 2
MAX_LINE = 1000  # characters of an error's one line


def _init_distributed() -> None:
    import jax

    if _COORDINATOR.value:
        # CPU processes need gloo for cross-process collectives (it only affects the CPU
        # backend). Querying the backend here would initialise it too early.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            coordinator_address=_COORDINATOR.value,
            num_processes=_NUM_PROCESSES.value,
            process_id=_PROCESS_ID.value,
        )
        return
    wanted = _DISTRIBUTED.value
    if wanted is None:  # a multi-host TPU slice or a SLURM job sets these
        wanted = bool(os.environ.get("TPU_WORKER_HOSTNAMES") or os.environ.get("SLURM_NTASKS"))
    if wanted:
        jax.distributed.initialize()


def _load_config():
    """The parsed --config, or a one-line UsageError naming the file (parse_flags has
    checked that it exists)."""
    given = config_flags.get_config_filename(flags.FLAGS["config"])
    try:
        return _CONFIG.value
    except Exception as e:
        cause = e.__cause__ or e
        raise app.UsageError(f"--config={given}: {type(cause).__name__}: {cause}") from e


def run(argv) -> int:
    """Everything `main` does; returns the exit status."""
    del argv
    if not _WORKDIR.value:
        raise app.UsageError("--workdir is required")
    config = _load_config()
    _validate_early(config)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    # Orbax and TFDS log every file they touch at INFO through absl; keep ours readable.
    logging.getLogger("absl").setLevel(logging.WARNING)
    _init_distributed()
    import jax

    from gspo_jax.trainer import loop, preemption

    log.info(
        "JAX %s: process %d/%d, %d local / %d global devices (%s)",
        jax.__version__,
        jax.process_index(),
        jax.process_count(),
        jax.local_device_count(),
        jax.device_count(),
        jax.devices()[0].platform,
    )
    summary = loop.run(config, _WORKDIR.value, allow_config_change=_ALLOW_CONFIG_CHANGE.value)
    if jax.process_index() == 0:
        log.info("done: %s", summary)
    if summary.get("preempted"):
        import signal

        return preemption.exit_status(signal.Signals[summary["preempted"]])
    return 0


def _validate_early(config) -> None:
    """The config checks that need no devices, before JAX starts a backend or the
    distributed runtime (15-45 s on a loaded or TPU host): a config error is the first
    thing a run says. setup() validates again with the devices; its warnings show then."""
    import warnings

    from gspo_jax.config import validate as config_lib

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", config_lib.ConfigWarning)
        config_lib.validate(config)


def parse_flags(argv):
    """absl's flag parsing, its errors on one line. A missing --config file is named first
    (ml_collections reports it lazily, at whichever override touches the config); a config
    file whose get_config raises is parsed here too: its traceback's last line is the cause."""
    _check_config_file(argv)
    try:
        return flags.FLAGS(argv)
    except Exception as e:  # noqa: BLE001 - flags.Error, or a config file's own error
        lines = [x.strip() for x in str(e).splitlines() if x.strip()]
        text = _flag_error(e, argv) or (lines[0] if lines else type(e).__name__)
        if "--debug" in argv or "--debug=true" in argv:
            text = str(e)
        elif len(lines) > 1 and "Traceback" in str(e):
            text = f"{text} {lines[-1]}"
        print(f"gspo_jax: error: {text}", file=sys.stderr, flush=True)
        sys.exit(EXIT_USAGE)


def _flag_error(error: Exception, argv) -> str | None:
    """A bad flag value or an unknown config field as one line naming the flag and its value
    (absl's own is a tuple repr for a bad boolean; ml_collections' names only the key);
    None for any other error."""
    cause = error.__cause__ or error.__context__
    if isinstance(error, flags.IllegalFlagValueError) and isinstance(cause, ValueError):
        flag = str(error).split(": ", 1)[0].removeprefix("flag ")  # --name=value
        reason = str(cause.args[0]) if cause.args else str(cause)
        for start, says in (
            ("Non-boolean argument", "must be true or false"),
            ("invalid literal for int()", "must be an integer"),
            ("could not convert string to float", "must be a number"),
        ):
            if reason.startswith(start):
                return f"{flag}: {says}"
        return None  # e.g. a config file's own error: parse_flags's first and last line
    missing = next((x for x in (error, cause, *error.args[:1]) if isinstance(x, KeyError)), None)
    if isinstance(error, (AttributeError, KeyError)) and missing is not None and missing.args:
        # ml_collections: KeyError("'name'\nDid you mean ...?") for --config.a.name=...
        key, *hint = str(missing.args[0]).splitlines()
        key = key.strip("'\"")
        for arg in argv:
            path = arg.removeprefix("--").split("=", 1)[0].split(".")
            if path[0] == "config" and key in path[1:]:
                hint = f"; {hint[0][0].lower()}{hint[0][1:]}" if hint and hint[0] else ""
                return f"{arg}: the config has no field {key!r}{hint}"
    return None


def _check_config_file(argv) -> None:
    for i, arg in enumerate(argv):
        if arg.startswith("--config="):
            given = arg.split("=", 1)[1]
        elif arg == "--config" and i + 1 < len(argv):
            given = argv[i + 1]
        else:
            continue
        path = given if os.path.isfile(given) else given.split(":", 1)[0]  # <file>.py:arg
        if not os.path.isfile(path):
            print(f"gspo_jax: error: --config={given}: no such file", file=sys.stderr, flush=True)
            sys.exit(EXIT_USAGE)


def main(argv) -> None:
    try:
        status = run(argv)
    except KeyboardInterrupt:
        print("gspo_jax: interrupted", file=sys.stderr, flush=True)
        status = 130
    except Exception as e:  # noqa: BLE001 - every error ends here, on one line
        status = _report(e)
        checkpoint = sys.modules.get("gspo_jax.trainer.io.checkpoint")
        if checkpoint is not None and isinstance(e, checkpoint.CheckpointError):
            # Its write may be stuck in a filesystem that stopped answering, in a thread that
            # no exit can join (and a daemon thread stopped inside C++ at finalisation can
            # abort the process): the run's files are closed and its line is out, so end now.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(status)
    _exit(status)


def _report(error: BaseException) -> int:
    """One line on stderr; the traceback behind --debug, or in WORKDIR/error.log."""
    from gspo_jax.config.validate import ConfigError

    usage = isinstance(error, (ConfigError, app.UsageError))
    text = " ".join(str(error).split()) or type(error).__name__
    if len(text) > MAX_LINE:  # the whole message is in the traceback file
        text = text[: MAX_LINE - 3] + "..."
    if not usage and not isinstance(error, (ValueError, OSError, RuntimeError, KeyError)):
        text = f"{type(error).__name__}: {text}"
    trace = "".join(traceback.format_exception(error))
    where = ""
    if _DEBUG.value:
        sys.stderr.write(trace)
    elif not usage:
        where = _save_traceback(trace)
    print(f"gspo_jax: error: {text}{where}", file=sys.stderr, flush=True)
    return EXIT_USAGE if usage else EXIT_ERROR


def _save_traceback(trace: str) -> str:
    workdir = _WORKDIR.value
    if not workdir or not os.path.isdir(workdir):
        return " (--debug prints the traceback)"
    index = _process_index()
    path = os.path.join(workdir, "error.log" if index == 0 else f"error.process{index}.log")
    try:
        with open(path, "w") as f:
            f.write(trace)
    except OSError:
        return " (--debug prints the traceback)"
    return f" (traceback: {path}; --debug prints it)"


def _process_index() -> int:
    if "jax" not in sys.modules:
        return 0
    try:
        return sys.modules["jax"].process_index()
    except Exception:  # noqa: BLE001 - the runtime may be the thing that failed
        return 0


def _exit(status: int) -> None:
    """sys.exit(status), with a daemon timer that ends the process if some non-daemon
    thread (a stuck orbax commit, a verifier pool) would keep it alive past the grace."""

    def force():
        alive = [t.name for t in threading.enumerate() if t.is_alive() and not t.daemon]
        print(
            f"gspo_jax: still shutting down after {SHUTDOWN_GRACE_S:.0f} s (threads: "
            f"{', '.join(alive) or 'none'}); exiting with status {status}",
            file=sys.stderr,
            flush=True,
        )
        os._exit(status)

    timer = threading.Timer(SHUTDOWN_GRACE_S, force)
    timer.daemon = True
    timer.start()
    sys.exit(status)


if __name__ == "__main__":
    from gspo_jax.notices import quiet_known_notices

    quiet_known_notices()  # before anything imports transformers or starts a JAX backend
    app.run(main, flags_parser=parse_flags)
