"""A persistent pool of reward worker processes: per-item timeouts that really stop a verifier.

`scoring.score_batch` uses it whenever `timeout_s` is set. Items go to worker processes
that run `items.evaluate_item`. A worker that exceeds the timeout is SIGKILLed (which
also stops a verifier stuck in C code that ignores signals, such as a catastrophic
regex) and replaced; the items it had not started go to other workers. A worker that
dies while scoring (segfault, os._exit) counts as an error for the item it was running.

A worker is a fresh interpreter started by fork+exec (`subprocess`, exactly how
multiprocessing's "spawn" start method starts one; never a bare fork of the
multi-threaded JAX parent) that talks to the parent over a `multiprocessing.connection`
socket. Unlike "spawn" and "forkserver" it does not re-run the parent's `__main__`
(which would re-import JAX and the trainer in every worker, and recurse into an
unguarded script): it imports only this package, then the modules that registered the
reward, by name, using the parent's sys.path. Rewards therefore reach workers by name
(`Reward` pickles as its spec plus those modules) and must be registered in an
importable module, not in `__main__` (a clear error says so). POSIX only. Workers exit
when the pool closes (at interpreter exit at the latest), and on their own within about
a second if the parent dies without closing it. What a worker costs against in-process
scoring (start-up, per item) is measured in docs/benchmarks.md, "Reward workers".

`timeout_s` is per item: the wall time from when a worker could start the item (its
previous result, or the chunk's dispatch, as seen by the parent) to its result.
Configuration problems (a worker that cannot start, or cannot import the module that
registers the reward) raise: they are not bad data.
"""

from __future__ import annotations

import atexit
import collections
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Self

import numpy as np

from gspo_jax.rewards import registry
from gspo_jax.rewards.items import MAX_MESSAGES, STATUS_ERROR, STATUS_TIMEOUT, evaluate_item
from gspo_jax.rewards.registry import Reward

# Items per message to a worker. Small chunks balance load and bound what one hang
# delays; large ones amortise pickling. Results come back one message per item, so
# the timeout stays per item whatever the chunk size.
MAX_CHUNK = 64


def default_num_workers() -> int:
    """min(4, CPU count): verifiers are cheap; more workers mostly cost memory."""
    return max(1, min(4, os.cpu_count() or 1))


# ----------------------------------------------------------------------------- worker

# How often a waiting parent re-checks worker liveness, and a worker checks that its
# parent is still there, in seconds.
_POLL_S = 1.0

# The signals that end a job (trainer/preemption.py `SIGNALS`; not imported from there, a
# worker imports only this package): they reach the whole process group, and the parent
# decides what to do with them.
WORKER_IGNORED_SIGNALS = (
    signal.SIGTERM,
    signal.SIGINT,
    signal.SIGHUP,
    signal.SIGUSR1,
    signal.SIGUSR2,
    signal.SIGXCPU,
)


def _watch_parent(parent_pid: int) -> None:
    """Exits the worker when its parent is gone (killed without running atexit)."""
    while True:
        time.sleep(_POLL_S)
        if os.getppid() != parent_pid:
            os._exit(0)


def _worker_main(fd: int, parent_pid: int) -> None:
    """Worker loop: receive (spec, modules, items), send one result per item.

    Started by `_Worker` as `python -c ...` with the parent's end of a socket pair at
    file descriptor `fd`. The first message is the parent's sys.path, so modules that
    register rewards import as they do in the parent.
    """
    # Ctrl-C, SIGTERM from a preemption or `kill -- -PGID`, SIGHUP from a dropped SSH
    # connection, a batch system's SIGUSR1 / SIGUSR2 warning go to the whole process
    # group; the parent decides what to do. A worker that died of one mid-item would score
    # that item as an error in the step the parent is finishing and checkpointing
    # (preemption.py); the parent stops its workers when it exits (or they notice it gone).
    for signum in WORKER_IGNORED_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    conn = multiprocessing.connection.Connection(fd)
    try:
        _serve(conn)
    except (EOFError, OSError):
        # The parent is gone (it exited, died or closed the pool): nothing to report to,
        # and a traceback from each worker would bury the parent's own one-line error.
        return


def _serve(conn) -> None:
    sys.path[:] = conn.recv()
    conn.send(("ready", os.getpid()))
    rewards: dict[tuple[str, tuple[str, ...]], Reward] = {}
    while True:
        message = conn.recv()
        if message is None:
            return
        spec, modules, items = message
        key = (spec, modules)
        if key not in rewards:
            try:
                registry.import_reward_modules(modules)
                rewards[key] = registry.build_reward(spec)
            except Exception as e:  # noqa: BLE001 - reported to the parent, which raises
                conn.send(("setup_error", f"{type(e).__name__}: {e}"))
                continue
        reward = rewards[key]
        for index, prompt, completion, reference, *example in items:  # example: 0 or 1
            status, total, values, text = evaluate_item(
                reward, prompt, completion, reference, *example
            )
            conn.send(("result", index, status, total, values, text))


# The directory holding the gspo_jax package, put on the worker's PYTHONPATH so the
# bootstrap import works even when the parent found the package through its cwd.
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_BOOTSTRAP = "import sys; from gspo_jax.rewards.pool import _worker_main; " + (
    "_worker_main(int(sys.argv[1]), int(sys.argv[2]))"
)


class _Worker:
    """One worker process, its socket, and what the parent knows about its work.

    The process is a fresh interpreter (fork+exec, as multiprocessing's "spawn" start
    method does; never a bare fork of the multi-threaded JAX parent) that imports only
    this package, not the parent's __main__.
    """

    def __init__(self):
        if not sys.executable:
            raise RuntimeError("sys.executable is empty: cannot start reward worker processes")
        parent_sock, child_sock = socket.socketpair()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (_PACKAGE_ROOT, env.get("PYTHONPATH", "")) if p
        )
        try:
            self.process = subprocess.Popen(
                [
                    sys.executable,
                    "-P",
                    "-c",
                    _BOOTSTRAP,
                    str(child_sock.fileno()),
                    str(os.getpid()),
                ],
                pass_fds=(child_sock.fileno(),),
                stdin=subprocess.DEVNULL,
                env=env,
            )
        finally:
            child_sock.close()
        self.conn = multiprocessing.connection.Connection(parent_sock.detach())
        self.conn.send(list(sys.path))
        self.state = "booting"  # -> "idle" <-> "busy"; "dead" once stopped
        self.pending: collections.deque[int] = collections.deque()
        self.last_event = time.monotonic()  # boot start, or dispatch / last result

    def alive(self) -> bool:
        return self.process.poll() is None

    def kill(self) -> None:
        if self.alive():
            self.process.kill()
        try:
            self.process.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            pass  # unkillable (uninterruptible kernel sleep): nothing more we can do
        self.conn.close()
        self.state = "dead"


def _stop_workers(workers: list[_Worker], owner_pid: int | None = None) -> None:
    """Asks idle workers to exit, kills the rest; never blocks more than ~1 s.

    With `owner_pid`, does nothing in any other process: a child forked from the
    trainer (a data loader, say) inherits the pool's exit hook but not its workers.
    """
    if owner_pid is not None and os.getpid() != owner_pid:
        return
    for worker in workers:
        if worker.state == "idle":
            try:
                worker.conn.send(None)
            except (OSError, ValueError):
                pass
    deadline = time.monotonic() + 1.0
    for worker in workers:
        if worker.state == "dead":
            continue
        if worker.state == "idle":
            try:
                worker.process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        worker.kill()
    workers.clear()


class RewardPool:
    """A persistent pool of reward worker processes (see the module docstring).

    Workers start lazily on the first batch and stay up between batches; `close()`
    (also called at interpreter exit, and by `with RewardPool() as pool:`) stops them.
    One batch at a time: concurrent `score` calls are serialised by a lock.
    """

    def __init__(self, num_workers: int | None = None, *, startup_timeout_s: float = 120.0):
        num_workers = default_num_workers() if num_workers is None else num_workers
        if not isinstance(num_workers, int) or num_workers < 1:
            raise ValueError(f"num_workers must be a positive int, got {num_workers!r}")
        self.num_workers = num_workers
        self.startup_timeout_s = startup_timeout_s
        self.num_restarts = 0  # workers replaced after a timeout or crash, over the pool's life
        self._workers: list[_Worker] = []
        self._lock = threading.Lock()
        self._closed = False
        # Runs at close(), garbage collection or interpreter exit, whichever is first;
        # holds the worker list, not the pool, so the pool can still be collected.
        self._finalizer = weakref.finalize(self, _stop_workers, self._workers, os.getpid())

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def worker_pids(self) -> list[int]:
        """Process ids of the current workers (for tests and debugging)."""
        return [w.process.pid for w in self._workers]

    def close(self) -> None:
        """Stops all workers (idempotent; the pool cannot be used afterwards)."""
        with self._lock:
            self._closed = True
            _stop_workers(self._workers)

    def _replace(self, worker: _Worker) -> None:
        worker.kill()
        self._workers[self._workers.index(worker)] = _Worker()
        self.num_restarts += 1

    def score(
        self,
        reward: Reward,
        prompts: Sequence[str],
        completions: Sequence[str],
        references: Sequence[str],
        *,
        timeout_s: float | None,
        examples: Sequence[dict | None] | None = None,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, dict[int, str], int]:
        """Scores B items: (status_B int8, totals_B float64, values_BK float64,
        messages {index: text}, number of workers replaced in this batch). `examples`: each
        item's fields for the terms that ask for them (None: none)."""
        examples = [None] * len(prompts) if examples is None else examples
        if "__main__" in reward.modules:
            raise ValueError(
                f"reward {reward.spec!r} is registered in __main__, which worker processes "
                "do not import: register it in an importable module, or score in-process "
                "with timeout_s=None"
            )
        with self._lock:
            if self._closed:
                raise RuntimeError("RewardPool is closed")
            restarts_before = self.num_restarts
            try:
                while len(self._workers) < self.num_workers:
                    self._workers.append(_Worker())
                items = (prompts, completions, references, examples)
                outputs = self._score(reward, items, timeout_s)
            except BaseException:
                # Interrupted or misconfigured mid-batch: workers may still hold stale
                # items, so none of them is reused (new ones start on the next batch).
                _stop_workers(self._workers)
                raise
            return (*outputs, self.num_restarts - restarts_before)

    def _score(self, reward, items, timeout_s):
        batch = _Batch(len(items[0]), len(reward.names))
        while batch.remaining:
            self._dispatch(batch, reward, items)
            watched = [w for w in self._workers if w.state in ("busy", "booting")]
            # Unscored items are queued (and idle workers were just given some) or
            # pending on a busy worker, so something is always being watched.
            assert watched, "reward pool has unscored items but no busy or booting worker"
            self._wait(watched, timeout_s)
            now = time.monotonic()
            for worker in watched:
                self._collect(worker, batch, reward, now)
            for worker in list(self._workers):
                elapsed = now - worker.last_event
                if worker.state == "booting" and elapsed > self.startup_timeout_s:
                    raise RuntimeError(
                        f"reward worker did not start within {self.startup_timeout_s} s"
                    )
                if worker.state == "busy" and timeout_s is not None and elapsed >= timeout_s:
                    self._fail_current(
                        worker, batch, STATUS_TIMEOUT, f"timed out after {timeout_s} s"
                    )
        return batch.status_B, batch.totals_B, batch.values_BK, batch.messages

    def _dispatch(self, batch, reward, items) -> None:
        """Give every idle worker a chunk of the queue (chunks shrink as it empties);
        `items` = (prompts, completions, references, examples)."""
        now = time.monotonic()
        for worker in self._workers:
            if worker.state == "idle" and batch.queue:
                size = -(-len(batch.queue) // (2 * self.num_workers))
                chunk = [batch.queue.popleft() for _ in range(min(MAX_CHUNK, size))]
                sent = [(i, *(column[i] for column in items)) for i in chunk]
                worker.conn.send((reward.spec, reward.modules, sent))
                worker.state, worker.last_event = "busy", now
                worker.pending = collections.deque(chunk)

    def _wait(self, watched, timeout_s) -> None:
        """Until a watched worker sends something, or the nearest deadline (a start-up or
        an item's timeout), or a short poll that notices dead workers."""
        now = time.monotonic()
        deadlines = [now + _POLL_S]
        for worker in watched:
            if worker.state == "booting":
                deadlines.append(worker.last_event + self.startup_timeout_s)
            elif timeout_s is not None:
                deadlines.append(worker.last_event + timeout_s)
        multiprocessing.connection.wait(
            [w.conn for w in watched], timeout=max(0.0, min(deadlines) - now)
        )

    def _collect(self, worker, batch, reward, now) -> None:
        """Read what `worker` sent; a worker that died fails its current item (its other
        pending items go back to the queue) and is replaced."""
        # Liveness first: a worker found dead has flushed everything it sent,
        # so draining after the check cannot miss a result it sent before dying.
        alive = worker.alive()
        died = False
        try:
            while worker.conn.poll():
                message = worker.conn.recv()
                if message[0] == "result":
                    _, index, status, total, values, text = message
                    worker.pending.remove(index)
                    batch.record(index, status, total, values, text)
                    worker.last_event = now
                elif message[0] == "ready":
                    worker.state, worker.last_event = "idle", now
                elif message[0] == "setup_error":
                    raise RuntimeError(
                        f"reward worker could not build reward {reward.spec!r} "
                        f"(is it registered in an importable module?): {message[1]}"
                    )
        except (EOFError, OSError):
            died = True
        if alive and not died:
            if worker.state == "busy" and not worker.pending:
                worker.state = "idle"
            return
        if worker.state == "booting":
            worker.kill()
            raise RuntimeError(
                "reward worker process exited during start-up with exit code "
                f"{worker.process.returncode}; see its stderr above"
            )
        if worker.pending:
            worker.kill()  # reap it so the exit code is known
            self._fail_current(
                worker,
                batch,
                STATUS_ERROR,
                f"worker process died (exit code {worker.process.returncode}) "
                "while scoring this item",
            )
        else:
            self._replace(worker)

    def _fail_current(self, worker, batch, status, text) -> None:
        """The first pending item is the one the worker was running; the rest were never
        started and go back to the front of the queue, in order. The worker is replaced."""
        batch.record(worker.pending.popleft(), status, 0.0, 0.0, text)
        batch.queue.extendleft(reversed(worker.pending))
        worker.pending.clear()
        self._replace(worker)


class _Batch:
    """One `score` call's items: results so far, the queue of unstarted items."""

    def __init__(self, num_items: int, num_terms: int):
        self.status_B = np.full(num_items, -1, np.int8)
        self.totals_B = np.zeros(num_items, np.float64)
        self.values_BK = np.zeros((num_items, num_terms), np.float64)
        self.messages: dict[int, str] = {}
        self.queue = collections.deque(range(num_items))
        self.remaining = num_items

    def record(self, index, status, total, values, text) -> None:
        self.status_B[index] = status
        self.totals_B[index] = total
        self.values_BK[index] = values
        if text is not None and len(self.messages) < MAX_MESSAGES:
            self.messages[index] = text
        self.remaining -= 1


_DEFAULT_POOL: RewardPool | None = None
_DEFAULT_POOL_LOCK = threading.Lock()


def get_default_pool(num_workers: int | None = None) -> RewardPool:
    """The process-wide pool `score_batch` uses; rebuilt if the requested number of
    workers differs from the current one. Closed at interpreter exit."""
    global _DEFAULT_POOL
    num_workers = default_num_workers() if num_workers is None else num_workers
    with _DEFAULT_POOL_LOCK:
        pool = _DEFAULT_POOL
        if pool is None or pool.closed or pool.num_workers != num_workers:
            if pool is not None:
                pool.close()
            _DEFAULT_POOL = pool = RewardPool(num_workers)
        return pool


def shutdown_default_pool() -> None:
    """Stops the default pool's workers (also runs at interpreter exit)."""
    global _DEFAULT_POOL
    with _DEFAULT_POOL_LOCK:
        if _DEFAULT_POOL is not None:
            _DEFAULT_POOL.close()
            _DEFAULT_POOL = None


atexit.register(shutdown_default_pool)
