#!/usr/bin/env python3
"""Run gspo_jax on a Cloud TPU VM slice: create it, ship the code, train, watch, stop, delete.

Every host of a slice runs the same `python -m gspo_jax.main` (multi-controller JAX); this
script drives them all through `gcloud compute tpus tpu-vm ssh/scp --worker=all`. It is
launched as `bash launch/tpu_pod.sh COMMAND ...` and needs only Python >= 3.9 and gcloud on
the machine you type on (nothing from the project's venv).

On each host everything lives under REMOTE_DIR (default ~/gspo_jax):

    code/       the tracked files of your HEAD commit (`git archive`), replaced whole on
                every `setup`; code/COMMIT names the commit
    venv/       Python >= 3.11 venv with jax[tpu] at requirements.txt's jax pin; kept
                across `setup`s (pip only installs what changed)
    run.log     the trainer's output (appended; one header line per `run`)
    run.pid     the running trainer's process (group) id

`--dry-run` (or DRY_RUN=1) prints each command that would run, one per line and quoted so
that pasting the line into a shell runs exactly it, and runs nothing except read-only git
queries (HEAD's commit, whether tracked files changed, requirements.txt's jax pin).
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
import tempfile

# Runtime (software) version per TPU generation: the versions Google's "TPU software
# versions" page (cloud.google.com/tpu/docs/runtimes) lists for JAX and PyTorch. Each is an
# Ubuntu 22.04 image whose python3 is 3.10, older than the pinned jax needs: see
# `setup --install-python`. Override with --runtime-version.
RUNTIME_VERSIONS = {
    "v6e": "v2-alpha-tpuv6e",
    "v5p": "v2-alpha-tpuv5",
    "v5litepod": "v2-alpha-tpuv5-lite",
    "v4": "tpu-ubuntu2204-base",
    "v3": "tpu-ubuntu2204-base",
    "v2": "tpu-ubuntu2204-base",
}
MIN_PYTHON = (3, 11)  # requires-python of pyproject.toml; the pinned jax needs it too
INSTALL_PYTHON = "python3.11"  # what `setup --install-python` installs and then uses
LOG_TAIL_LINES = 200

USAGE = """\
usage: bash launch/tpu_pod.sh [options] COMMAND [args]

Run gspo_jax on every host of a Cloud TPU VM slice through gcloud.

commands:
  create                 create the TPU VM (a queued resource with --queued)
  setup                  ship HEAD's tracked files to every host and install the venv
                         (again after each commit: the code is replaced in place)
  run CONFIG WORKDIR [FLAG ...]
                         start `python -m gspo_jax.main --config=CONFIG --workdir=WORKDIR
                         --distributed FLAG ...` in the background on every host; WORKDIR
                         must be an absolute path, shared by all hosts on a multi-host slice
  logs                   stream a host's run.log (--worker, default 0); Ctrl-C stops the
                         stream, not the run
  status                 describe the TPU and say whether a run is going on each host
  stop                   stop the run on every host (the TPU keeps running and billing)
  ssh [COMMAND ...]      a shell on --worker (default 0), or run COMMAND there (--worker=all)
  delete                 delete the TPU VM (with --queued: the queued resource and its TPU)

options (each also read from the environment variable in capitals):
  --tpu NAME             TPU      TPU VM name (required)
  --zone ZONE            ZONE     e.g. us-east5-a (required)
  --project PROJECT      PROJECT  default: gcloud's configured project
  --accelerator TYPE     ACCELERATOR  create: v5litepod-8 (v5e-8 is accepted), v5p-64,
                                  v4-32, v6e-8, ...
  --runtime-version V    RUNTIME_VERSION  create: default per generation (v6e:
                                  v2-alpha-tpuv6e, v5p: v2-alpha-tpuv5, v5e:
                                  v2-alpha-tpuv5-lite, v4 and older: tpu-ubuntu2204-base)
  --queued               QUEUED=1 create/status/delete a queued resource named like the TPU
  --spot                 create: a Spot TPU (cheaper, preemptible)
  --best-effort          create --queued: the alpha best-effort tier (gcloud alpha)
  --reserved             create: use the project's reservation
  --remote-dir DIR       REMOTE_DIR  per-host directory (default gspo_jax, i.e. ~/gspo_jax)
  --python PYTHON        HOST_PYTHON  interpreter for the hosts' venv (default python3)
  --install-python       setup: apt-get install python3.11 + python3.11-venv on every host
                                  first, and use it
  --allow-dirty          setup: ship HEAD although tracked files have uncommitted changes
  --worker N|all         logs/ssh: which host (default 0)
  --libtpu-init-args ARGS LIBTPU_INIT_ARGS  run: the XLA:TPU flags the trainer gets (default:
                                  async collectives overlapped with compute, listed in
                                  docs/tpu_pods.md; "none": no flags)
  --yes                  delete without gcloud's confirmation prompt
  --dry-run              DRY_RUN=1  print every command instead of running it
  -h, --help             this help

example (a v5p-64: 32 chips on 8 hosts):
  export TPU=gspo-v5p ZONE=us-east5-a PROJECT=my-project
  bash launch/tpu_pod.sh create --accelerator=v5p-64 --queued --spot
  bash launch/tpu_pod.sh setup --install-python
  bash launch/tpu_pod.sh run configs/qwen3_0p6b_gsm8k.py:hf_path=/mnt/shared/Qwen3-0.6B,manual_dir=/mnt/shared/gsm8k \\
      /mnt/shared/runs/qwen3_gspo --config.mesh.data=1 --config.mesh.fsdp=-1
  bash launch/tpu_pod.sh logs
  bash launch/tpu_pod.sh stop && bash launch/tpu_pod.sh delete --queued
Full guide: docs/tpu_pods.md.
"""


class UsageError(Exception):
    """A missing or bad argument: printed with the usage line, exit status 2."""


class LaunchError(Exception):
    """A problem found before running anything (dirty tree, bad pin): exit status 1."""


# ------------------------------------------------------------------------------ arguments


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse would print its own usage and exit
        raise UsageError(message)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="tpu_pod.sh", add_help=False)  # -h prints USAGE (main)
    p.add_argument("-h", "--help", action="store_true")
    p.add_argument("--tpu")
    p.add_argument("--zone")
    p.add_argument("--project")
    p.add_argument("--accelerator")
    p.add_argument("--runtime-version")
    p.add_argument("--queued", action="store_true", default=None)
    p.add_argument("--spot", action="store_true")
    p.add_argument("--best-effort", action="store_true")
    p.add_argument("--reserved", action="store_true")
    p.add_argument("--remote-dir")
    p.add_argument("--python")
    p.add_argument("--install-python", action="store_true")
    p.add_argument("--allow-dirty", action="store_true")
    p.add_argument("--worker")
    p.add_argument("--libtpu-init-args")
    p.add_argument("--yes", action="store_true")
    p.add_argument("--dry-run", action="store_true", default=None)
    return p


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, str | None, list[str]]:
    """(options, command, the command's arguments).

    Options may come before or after the command. Everything after `run CONFIG WORKDIR` and
    after `ssh`'s first non-option word is passed on verbatim (trainer flags, a remote
    command); `--` ends the options explicitly.
    """
    parser = _parser()
    opts_argv, command, rest = [], None, []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            rest.extend(argv[i + 1 :])
            break
        if arg.startswith("-"):
            opts_argv.append(arg)
            # an option's separate value (`--tpu NAME`); `--tpu=NAME` is one word
            if "=" not in arg and _takes_value(parser, arg) and i + 1 < len(argv):
                opts_argv.append(argv[i + 1])
                i += 1
        elif command is None:
            command = arg
        else:
            rest.append(arg)
            # run keeps CONFIG WORKDIR positional, then every later word is the trainer's
            if command == "run" and len(rest) == 2 or command == "ssh":
                rest.extend(argv[i + 1 :])
                break
        i += 1
    opts, unknown = parser.parse_known_args(opts_argv)
    if unknown:
        raise UsageError(f"unknown option {unknown[0]!r}")
    return opts, command, rest


def _takes_value(parser: argparse.ArgumentParser, flag: str) -> bool:
    for action in parser._actions:  # argparse has no public lookup
        if flag in action.option_strings:
            return action.nargs != 0
    return False


def resolve(opts: argparse.Namespace, env: dict[str, str]) -> argparse.Namespace:
    """Fill options from the environment (flags win) and normalise them."""

    def pick(name, var):
        value = getattr(opts, name)
        return value if value not in (None, "") else (env.get(var) or None)

    def flag(name, var):
        value = getattr(opts, name)
        return bool(value) if value is not None else env.get(var, "") not in ("", "0")

    o = argparse.Namespace(**vars(opts))
    o.tpu = pick("tpu", "TPU")
    o.zone = pick("zone", "ZONE")
    o.project = pick("project", "PROJECT")
    o.accelerator = pick("accelerator", "ACCELERATOR")
    o.runtime_version = pick("runtime_version", "RUNTIME_VERSION")
    o.remote_dir = pick("remote_dir", "REMOTE_DIR") or "gspo_jax"
    o.python = pick("python", "HOST_PYTHON")
    o.queued = flag("queued", "QUEUED")
    o.libtpu_init_args = pick("libtpu_init_args", "LIBTPU_INIT_ARGS") or DEFAULT_LIBTPU_INIT_ARGS
    o.dry_run = flag("dry_run", "DRY_RUN")
    # ssh commands and scp paths start in the home directory: ~/x is just x
    o.remote_dir = o.remote_dir.removeprefix("~/")
    if not re.fullmatch(r"[A-Za-z0-9._/-]+", o.remote_dir):
        # scp may hand the remote path to a shell: keep it to characters needing no quotes
        raise UsageError(f"--remote-dir {o.remote_dir!r}: use only letters, digits, . _ / -")
    if o.install_python and o.python:
        raise UsageError(f"--install-python installs and uses {INSTALL_PYTHON}: drop --python")
    if o.python is None:
        o.python = INSTALL_PYTHON if o.install_python else "python3"
    if o.worker is not None and o.worker != "all" and not o.worker.isdigit():
        raise UsageError(f"--worker={o.worker!r}: a host number (0, 1, ...) or all")
    if sum((o.spot, o.best_effort, o.reserved)) > 1:
        raise UsageError("choose at most one of --spot, --best-effort, --reserved")
    if o.best_effort and not o.queued:
        raise UsageError("--best-effort exists only for queued resources: add --queued")
    return o


def require(o: argparse.Namespace, *names: str) -> None:
    what = {
        "tpu": ("the TPU name", "--tpu NAME", "TPU"),
        "zone": ("the zone", "--zone ZONE", "ZONE"),
        "accelerator": ("the accelerator type", "--accelerator TYPE", "ACCELERATOR"),
    }
    for name in names:
        if not getattr(o, name):
            label, flag, var = what[name]
            raise UsageError(f"missing {label} {var}: pass {flag} or set {var}=...")


def accelerator_type(name: str) -> str:
    """v5e-N is accepted and sent as v5litepod-N, the name the TPU API documents."""
    return re.sub(r"^v5e-", "v5litepod-", name)


def runtime_version_for(accelerator: str) -> str:
    generation = accelerator.split("-")[0]
    if generation not in RUNTIME_VERSIONS:
        raise UsageError(
            f"no default runtime version for accelerator {accelerator!r} (known generations: "
            f"{', '.join(RUNTIME_VERSIONS)}): pass --runtime-version"
        )
    return RUNTIME_VERSIONS[generation]


# ------------------------------------------------------------------------ remote scripts
# Each remote command is a constant POSIX sh script preceded by shell assignments of the
# values it needs (R: the remote dir, PY: the interpreter, ...). Those values and the
# trainer's arguments (shlex-joined into _RUN) are the only text from the user in a script,
# and all are shlex-quoted. gcloud hands --command to the host's login shell, so that
# quoting is undone exactly once there.

_CHECK_PYTHON = (
    'command -v "$PY" >/dev/null 2>&1 || {'
    ' echo "gspo_jax setup: $PY not found on $(hostname). Re-run setup with --install-python'
    ' (apt-installs python3.11 and python3.11-venv on every host) or --python=PATH." >&2;'
    " exit 1; }; "
    '"$PY" -c "import sys; sys.exit(sys.version_info < @MIN@)" || {'
    ' echo "gspo_jax setup: the pinned jax needs Python >= @MIN_DOTTED@, but $PY on'
    ' $(hostname) is $("$PY" --version 2>&1). Re-run setup with --install-python'
    " (apt-installs python3.11 and python3.11-venv on every host) or --python=PATH to a"
    ' Python >= @MIN_DOTTED@." >&2; exit 1; }; '
    '"$PY" -c "import ensurepip, venv" >/dev/null 2>&1 || {'
    ' echo "gspo_jax setup: $PY on $(hostname) cannot make a venv (Debian/Ubuntu split it'
    ' out): sudo apt-get install -y $(basename "$PY")-venv, or re-run setup with'
    ' --install-python." >&2; exit 1; }; '
    'if [ -f "$R/run.pid" ] && kill -0 "$(cat "$R/run.pid")" 2>/dev/null; then'
    ' echo "gspo_jax setup: a run is going on $(hostname) (pid $(cat "$R/run.pid")):'
    ' stop it first (tpu_pod.sh stop)." >&2; exit 1; fi; '
    'mkdir -p "$R"'
)

# apt may still be locked by unattended-upgrades right after a VM boots: wait for it.
# Ubuntu 22.04 ships python3.11 in universe; the deadsnakes PPA is the fallback.
_INSTALL_PYTHON = (
    'APT="sudo env DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 -y -q"; '
    '$APT update >/dev/null && { $APT install "$PY" "$PY-venv" || {'
    " $APT install software-properties-common"
    " && sudo add-apt-repository -y ppa:deadsnakes/ppa"
    ' && $APT update >/dev/null && $APT install "$PY" "$PY-venv"; }; }'
)

# The new tree is unpacked beside the old one and swapped in, so a file deleted from the
# repo disappears from the hosts and the copy never nests. The venv lives outside code/
# and is rebuilt only when missing or made by a too-old Python.
_INSTALL = (
    'set -e; cd "$R"; rm -rf code.new; mkdir code.new; tar -xzf code.tar.gz -C code.new; '
    'echo "$COMMIT" > code.new/COMMIT; rm -rf code; mv code.new code; rm -f code.tar.gz; '
    'if ! venv/bin/python -c "import sys; sys.exit(sys.version_info < @MIN@)" 2>/dev/null;'
    ' then rm -rf venv; "$PY" -m venv venv; fi; '
    'echo "gspo_jax: $(hostname): installing jax[tpu]==$JAX and code/requirements.txt into'
    ' $R/venv (minutes the first time)"; '
    "venv/bin/python -m pip install -q --upgrade pip; "
    'venv/bin/python -m pip install -q "jax[tpu]==$JAX" -r code/requirements.txt; '
    "venv/bin/python -m pip install -q --no-deps -e code; "
    'echo "gspo_jax: $(hostname) has commit $COMMIT in $R/code, jax'
    ' $(venv/bin/python -c "import jax; print(jax.__version__)")"'
)

# LIBTPU_INIT_ARGS the run gets unless --libtpu-init-args says otherwise: XLA:TPU flags that
# let collectives run asynchronously and overlap with compute (FSDP's weight all-gathers,
# the gradients' reduce-scatters), as MaxText's TPU scripts set them
# (end_to_end/tpu/test_host_offload.sh, its docs' "XLA flags" recipes). Each is accepted by
# the pinned libtpu (tests/launch/test_libtpu_flags.py compiles with them); an unknown flag
# makes libtpu abort at start-up. docs/tpu_pods.md says what each does.
DEFAULT_LIBTPU_INIT_ARGS = (
    "--xla_tpu_enable_async_collective_fusion=true"
    " --xla_tpu_enable_async_collective_fusion_fuse_all_gather=true"
    " --xla_tpu_enable_async_collective_fusion_multiple_steps=true"
    " --xla_tpu_overlap_compute_collective_tc=true"
    " --xla_enable_async_all_gather=true"
    " --xla_tpu_enable_data_parallel_all_reduce_opt=true"
    " --xla_tpu_data_parallel_opt_different_sized_ops=true"
)

# The trainer writes its own pid (sh's $$, kept by exec) before becoming python, so
# run.pid is right whether or not setsid forked; setsid gives it a process group of its
# own that `stop` signals whole (the reward worker pool included), and nohup plus the
# redirections let it outlive the ssh session.
_RUN = (
    'cd "$R/code" 2>/dev/null || {'
    ' echo "gspo_jax: no code in $R/code on $(hostname): run setup first." >&2; exit 1; }; '
    'if [ -f ../run.pid ] && kill -0 "$(cat ../run.pid)" 2>/dev/null; then'
    ' echo "gspo_jax: a run is already going on $(hostname) (pid $(cat ../run.pid)):'
    ' stop it first (tpu_pod.sh stop)." >&2; exit 1; fi; '
    'echo "=== $(date -u +%Y-%m-%dT%H:%M:%SZ) commit $(cat COMMIT) ===" >> ../run.log; '
    'export LIBTPU_INIT_ARGS=@LIBTPU@; echo "LIBTPU_INIT_ARGS=$LIBTPU_INIT_ARGS" >> ../run.log; '
    r'setsid nohup sh -c "echo \$\$ > ../run.pid && exec \"\$0\" \"\$@\""'
    " ../venv/bin/python -m gspo_jax.main @ARGS@ >> ../run.log 2>&1 < /dev/null & "
    'echo "gspo_jax: started on $(hostname); log: $R/run.log"'
)

# SIGTERM to the run's process group, SIGKILL after 30 s. `env kill`: the external kill
# takes `--` and a negative pid (a group) in any shell, dash's builtin does not.
_STOP = (
    'pid=$(cat "$R/run.pid" 2>/dev/null) && kill -0 "$pid" 2>/dev/null || {'
    ' echo "$(hostname): no run going on"; exit 0; }; '
    'env kill -s TERM -- "-$pid"; i=0; '
    'while kill -0 "$pid" 2>/dev/null && [ "$i" -lt 30 ]; do sleep 1; i=$((i + 1)); done; '
    'if kill -0 "$pid" 2>/dev/null; then env kill -s KILL -- "-$pid"; fi; '
    'echo "$(hostname): stopped run $pid"'
)

_STATUS = (
    'if [ -f "$R/run.pid" ] && kill -0 "$(cat "$R/run.pid")" 2>/dev/null; then'
    ' echo "$(hostname): running (pid $(cat "$R/run.pid"), commit $(cat "$R/code/COMMIT"))";'
    ' else echo "$(hostname): no run going on"; fi'
)

_LOGS = 'tail -n @LINES@ -F "$R/run.log"'


def _script(template: str, variables: dict[str, str], **fill: str) -> str:
    text = template
    fill = {
        "MIN": str(MIN_PYTHON),
        "MIN_DOTTED": ".".join(map(str, MIN_PYTHON)),
        "LINES": str(LOG_TAIL_LINES),
        **fill,
    }
    for key, value in fill.items():
        text = text.replace(f"@{key}@", value)
    assignments = "".join(f"{k}={shlex.quote(v)}; " for k, v in variables.items())
    return assignments + text


# -------------------------------------------------------------------------- plans


def _where(o) -> list[str]:
    return [f"--zone={o.zone}"] + ([f"--project={o.project}"] if o.project else [])


def ssh(o, script: str | None, worker: str = "all") -> list[str]:
    argv = ["gcloud", "compute", "tpus", "tpu-vm", "ssh", o.tpu, *_where(o), f"--worker={worker}"]
    return argv + ([f"--command={script}"] if script is not None else [])


def plan_create(o) -> list[list[str]]:
    require(o, "tpu", "zone", "accelerator")
    accel = accelerator_type(o.accelerator)
    version = o.runtime_version or runtime_version_for(accel)
    tier = ["--spot"] * o.spot + ["--best-effort"] * o.best_effort + ["--reserved"] * o.reserved
    if o.queued:
        # --best-effort is only in gcloud's alpha track (the GA one has --spot/--reserved).
        track = ["alpha"] if o.best_effort else []
        return [
            ["gcloud", *track, "compute", "tpus", "queued-resources", "create", o.tpu]
            + [f"--node-id={o.tpu}", *_where(o), f"--accelerator-type={accel}"]
            + [f"--runtime-version={version}", *tier]
        ]
    return [
        ["gcloud", "compute", "tpus", "tpu-vm", "create", o.tpu, *_where(o)]
        + [f"--accelerator-type={accel}", f"--version={version}", *tier]
    ]


def _git(repo: str, *args: str) -> str:
    out = subprocess.run(["git", "-C", repo, *args], capture_output=True, text=True, check=False)
    if out.returncode:
        raise LaunchError(f"git {' '.join(args)} failed in {repo}: {out.stderr.strip()}")
    return out.stdout


def jax_pin(requirements: str) -> str:
    """The version of the `jax==X` line of a requirements file's text."""
    for line in requirements.splitlines():
        match = re.fullmatch(r"\s*jax\s*==\s*([^\s;#]+)\s*(?:#.*)?", line)
        if match:
            return match.group(1)
    raise LaunchError("requirements.txt pins no jax version (expected a line `jax==X.Y.Z`)")


def plan_setup(o, repo: str) -> list[list[str]]:
    require(o, "tpu", "zone")
    changed = _git(repo, "status", "--porcelain", "--untracked-files=no").splitlines()
    if changed:
        files = ", ".join(line[3:] for line in changed)
        message = (
            f"tracked files have uncommitted changes ({files}); setup ships only the HEAD "
            "commit, so the hosts would run code without them"
        )
        if not o.allow_dirty:
            raise LaunchError(f"{message}. Commit (or stash) them, or pass --allow-dirty.")
        print(f"tpu_pod.sh: warning: {message}.", file=sys.stderr)
    untracked = _git(repo, "ls-files", "--others", "--exclude-standard").split()
    if untracked:
        more = f" and {len(untracked) - 5} more" if len(untracked) > 5 else ""
        print(
            f"tpu_pod.sh: note: untracked files are not shipped: {', '.join(untracked[:5])}"
            f"{more} (git add and commit what the run needs)",
            file=sys.stderr,
        )
    commit = _git(repo, "rev-parse", "HEAD").strip()
    # The pin of the commit being shipped, not of the working tree.
    jax = jax_pin(_git(repo, "show", "HEAD:requirements.txt"))
    tarball = os.path.join(tempfile.gettempdir(), f"gspo_jax-{commit[:12]}.tar.gz")
    variables = {"R": o.remote_dir, "PY": o.python}
    plan = []
    if o.install_python:
        plan.append(ssh(o, _script(_INSTALL_PYTHON, {"PY": o.python})))
    plan += [
        ssh(o, _script(_CHECK_PYTHON, variables)),
        ["git", "-C", repo, "archive", "--format=tar.gz", f"--output={tarball}", commit],
        ["gcloud", "compute", "tpus", "tpu-vm", "scp", tarball]
        + [f"{o.tpu}:{o.remote_dir}/code.tar.gz", *_where(o), "--worker=all"],
        ssh(o, _script(_INSTALL, {**variables, "COMMIT": commit, "JAX": jax})),
    ]
    return plan


def plan_run(o, args: list[str]) -> list[list[str]]:
    require(o, "tpu", "zone")
    if len(args) < 2:
        missing = "CONFIG and WORKDIR" if not args else "WORKDIR"
        raise UsageError(f"run needs {missing}: run CONFIG WORKDIR [--config.x=y ...]")
    config, workdir, extra = args[0], args[1], args[2:]
    launcher_options = {s for a in _parser()._actions for s in a.option_strings}
    for arg in extra:
        if arg.split("=", 1)[0] in launcher_options:
            # e.g. a trailing --dry-run would otherwise start a real run
            raise UsageError(
                f"{arg!r} after WORKDIR would go to the trainer; put launcher options before CONFIG"
            )
    if any("\n" in arg for arg in args):
        # a quoted newline would still work, but break the one-command-per-line printout
        raise UsageError("run arguments may not contain newlines")
    if workdir.startswith("gs://"):
        raise UsageError(
            f"WORKDIR {workdir}: the trainer writes its workdir with plain file calls, so a "
            "gs:// path does not work yet. Use a filesystem every host mounts (Filestore, or "
            "the bucket through gcsfuse: docs/tpu_pods.md) and pass its path."
        )
    if not workdir.startswith("/"):
        raise UsageError(
            f"WORKDIR {workdir!r} must be an absolute path on the hosts (a relative one would "
            "land inside the code directory that setup replaces)"
        )
    # --distributed: on a GCE TPU VM the slice's hosts are listed in the metadata server,
    # not in TPU_WORKER_HOSTNAMES, so main.py's auto-detection would not fire there.
    trainer = [f"--config={config}", f"--workdir={workdir}", "--distributed", *extra]
    libtpu = "" if o.libtpu_init_args == "none" else o.libtpu_init_args
    script = _script(
        _RUN, {"R": o.remote_dir}, ARGS=shlex.join(trainer), LIBTPU=shlex.quote(libtpu)
    )
    return [ssh(o, script)]


def plan_logs(o) -> list[list[str]]:
    require(o, "tpu", "zone")
    return [ssh(o, _script(_LOGS, {"R": o.remote_dir}), worker=o.worker or "0")]


def plan_status(o) -> list[list[str]]:
    require(o, "tpu", "zone")
    kind = ["queued-resources"] if o.queued else ["tpu-vm"]
    return [
        ["gcloud", "compute", "tpus", *kind, "describe", o.tpu, *_where(o)],
        ssh(o, _script(_STATUS, {"R": o.remote_dir})),
    ]


def plan_stop(o) -> list[list[str]]:
    require(o, "tpu", "zone")
    return [ssh(o, _script(_STOP, {"R": o.remote_dir}))]


def plan_ssh(o, args: list[str]) -> list[list[str]]:
    require(o, "tpu", "zone")
    return [ssh(o, " ".join(args) if args else None, worker=o.worker or "0")]


def plan_delete(o) -> list[list[str]]:
    require(o, "tpu", "zone")
    quiet = ["--quiet"] if o.yes else []
    if o.queued:
        # --force deletes the queued resource's TPU VM too (else it must be gone already).
        return [
            ["gcloud", "compute", "tpus", "queued-resources", "delete", o.tpu, *_where(o)]
            + ["--force", *quiet]
        ]
    return [["gcloud", "compute", "tpus", "tpu-vm", "delete", o.tpu, *_where(o), *quiet]]


def plan(o, command: str, args: list[str], repo: str) -> list[list[str]]:
    """The commands `command` runs, in order (each an argv list)."""
    plans = {
        "create": lambda: plan_create(o),
        "setup": lambda: plan_setup(o, repo),
        "run": lambda: plan_run(o, args),
        "logs": lambda: plan_logs(o),
        "status": lambda: plan_status(o),
        "stop": lambda: plan_stop(o),
        "ssh": lambda: plan_ssh(o, args),
        "delete": lambda: plan_delete(o),
    }
    if command not in plans:
        raise UsageError(f"unknown command {command!r} (one of: {', '.join(plans)})")
    if args and command not in ("run", "ssh"):
        raise UsageError(f"{command} takes no arguments (got {' '.join(args)!r})")
    return plans[command]()


# -------------------------------------------------------------------------- main


def main(argv: list[str] | None = None, env: dict[str, str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    env = dict(os.environ) if env is None else env
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        opts, command, args = parse_args(argv)
        if opts.help:
            sys.stdout.write(USAGE)
            return 0
        if command is None:
            raise UsageError("missing COMMAND")
        o = resolve(opts, env)
        commands = plan(o, command, args, repo)
    except UsageError as e:
        sys.stderr.write(f"tpu_pod.sh: {e}\n\n{USAGE}")
        return 2
    except LaunchError as e:
        print(f"tpu_pod.sh: {e}", file=sys.stderr)
        return 1
    for argv_ in commands:
        line = shlex.join(argv_)
        if o.dry_run:
            print(line, flush=True)
            continue
        print(f"+ {line}", file=sys.stderr, flush=True)
        try:
            code = subprocess.call(argv_)
        except FileNotFoundError:
            print(f"tpu_pod.sh: {argv_[0]} not found on PATH", file=sys.stderr)
            return 127
        except KeyboardInterrupt:  # Ctrl-C on `logs`: the run goes on
            return 130
        if code:
            print(f"tpu_pod.sh: {command}: command failed (exit {code})", file=sys.stderr)
            return code
    if command == "run" and not o.dry_run:
        print("started; stream the log with: bash launch/tpu_pod.sh logs", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
