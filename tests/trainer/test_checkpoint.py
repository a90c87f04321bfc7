"""Checkpoints that fail loudly: a damaged checkpoint falls back to the previous good one, a
model change is named, a save that cannot be written raises at once and leaves no thread
behind (the hang), and the digests behind the integrity check."""

import errno
import glob
import logging
import os
import shutil
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from etils.epath import abstract_path
from helpers import fill_disk, small_tmpfs

from gspo_jax import models
from gspo_jax import sharding as sharding_lib
from gspo_jax.trainer import state as state_lib
from gspo_jax.trainer.io import checkpoint

TINY = models.ModelConfig(
    arch="qwen3",
    vocab_size=32,
    hidden_size=16,
    intermediate_size=32,
    num_layers=1,
    num_heads=2,
    num_kv_heads=1,
    head_dim=8,
    qk_norm=True,
)


def _state_and_abstract(model_config=TINY, seed=0):
    """A RunState sharded over the 8 fake devices (params over fsdp), and its abstract."""
    mesh = sharding_lib.make_mesh({"data": 2, "fsdp": 4, "tensor": 1, "expert": 1})
    abstract_params = models.abstract_params(model_config)
    params_sh = sharding_lib.tree_shardings(
        abstract_params, models.logical_axes(model_config), mesh
    )
    tx = optax.adam(1e-3)
    shardings = state_lib.state_shardings(abstract_params, params_sh, tx, mesh, with_ref=False)
    init = jax.jit(models.init_params, static_argnums=0, out_shardings=params_sh)
    params = init(model_config, jax.random.PRNGKey(seed))
    state = state_lib.init_state(params, tx, seed, shardings, origin="test")
    return state, state_lib.abstract_state(abstract_params, tx, shardings)


@pytest.fixture(scope="module")
def tiny():
    return _state_and_abstract()


def _saved(tmp_path, state, steps):
    """A checkpoint directory with `steps` of `state` (params scaled by the step)."""
    manager = checkpoint.make_manager(str(tmp_path / "ckpt"), async_save=False)
    for step in steps:
        params = jax.tree.map(lambda p, s=step: p * s, state.train.params)
        scaled = state.train.replace(params=params)
        checkpoint.save(manager, state.replace(step=step, train=scaled, data=f"d{step}"))
    checkpoint.finish(manager)
    manager.close()
    return str(tmp_path / "ckpt")


def _restore(directory, abstract):
    manager = checkpoint.make_manager(directory, async_save=False)
    try:
        return checkpoint.restore_latest(manager, abstract)
    finally:
        manager.close()


def _data_files(directory, step):
    """The array data files of a step (ocdbt keeps the process's copy and the merged one)."""
    return glob.glob(os.path.join(directory, str(step), "state", "**", "d", "*"), recursive=True)


def _write(path, text, mode="w"):
    with open(path, mode) as f:
        f.write(text)


def _flip_bytes(directory, step):
    for path in _data_files(directory, step):
        with open(path, "rb") as f:
            data = bytearray(f.read())
        for i in range(0, len(data), 97):  # damage the whole file, not one spare byte
            data[i] ^= 0xFF
        _write(path, bytes(data), "wb")


def _swap_arrays(directory, step, other):
    """Step `step`'s array files replaced by step `other`'s: valid files, a readable index,
    other values. Orbax restores them without a word; only the digests see it."""
    shutil.rmtree(os.path.join(directory, str(step), "state"))
    shutil.copytree(
        os.path.join(directory, str(other), "state"), os.path.join(directory, str(step), "state")
    )


@pytest.mark.parametrize(
    "damage", ["swapped", "flip", "truncate", "garbage_meta", "garbage_metadata"]
)
def test_a_damaged_checkpoint_falls_back_to_the_previous_one(tiny, tmp_path, damage, caplog, capfd):
    """Flipped bytes used to restore silently (orbax checksums only the shard index);
    truncated files and garbage metadata failed without a fallback, under hundreds of
    lines of asyncio noise."""
    state, abstract = tiny
    directory = _saved(tmp_path, state, (1, 2, 3))
    if damage == "swapped":  # restored silently before: only the digests see it
        _swap_arrays(directory, 2, 3)
    shutil.rmtree(os.path.join(directory, "3"))  # step 2 is the latest
    if damage == "flip":
        _flip_bytes(directory, 2)
    elif damage == "truncate":
        for path in _data_files(directory, 2):
            os.truncate(path, os.path.getsize(path) // 2)
    elif damage == "garbage_meta":
        _write(os.path.join(directory, "2", "meta", "metadata"), "garbage{")
    elif damage == "garbage_metadata":
        _write(os.path.join(directory, "2", "state", "_METADATA"), "garbage{")
    with caplog.at_level(logging.WARNING, logger="gspo_jax.trainer.io.checkpoint"):
        restored = _restore(directory, abstract)
    noise = capfd.readouterr().err
    assert "Event loop is closed" not in noise and "Traceback" not in noise, noise[-2000:]
    assert restored.step == 1 and restored.data == "d1"
    assert restored.origin.startswith("checkpoint 1 in ")
    for got, want in zip(
        jax.tree.leaves(restored.train.params), jax.tree.leaves(state.train.params)
    ):
        np.testing.assert_array_equal(got, want)
    bad = os.path.join(directory, "2")
    warned = [r.getMessage() for r in caplog.records if bad in r.getMessage()]
    assert any("unusable" in m for m in warned), warned
    if damage == "swapped":
        assert any("differ from the digests saved with them" in m for m in warned), warned
    # Moved aside, kept for inspection: the next save or restart does not trip over it.
    assert not os.path.exists(bad) and os.path.isdir(bad + checkpoint.CORRUPT_SUFFIX)
    again = _restore(directory, abstract)
    assert again.step == 1


def test_reading_a_damaged_steps_metadata_is_quiet_too(tiny, tmp_path, capfd):
    """The shape check reads a step's metadata before restoring it; on a damaged step that
    read fails as noisily as the restore (tensorstore's late "Event loop is closed"
    tracebacks, seen in a run resuming past a truncated checkpoint). It is held back as well,
    and unreadable metadata alone is not a model change: the restore decides."""
    state, abstract = tiny
    directory = _saved(tmp_path, state, (1, 2))
    manager = checkpoint.make_manager(directory, async_save=False)
    read = manager.item_metadata

    def noisy(step):
        if step == 2:
            print("Traceback (most recent call last):", file=sys.stderr)
            print("RuntimeError: Event loop is closed", file=sys.stderr)
            raise ValueError("OUT_OF_RANGE: Error reading _METADATA")
        return read(step)

    manager.item_metadata = noisy
    try:
        restored = checkpoint.restore_latest(manager, abstract)
    finally:
        manager.close()
    noise = capfd.readouterr().err
    assert "Event loop is closed" not in noise and "Traceback" not in noise, noise[-2000:]
    assert restored.step == 2 and restored.data == "d2"


def test_no_usable_checkpoint_is_an_error_listing_each(tiny, tmp_path):
    state, abstract = tiny
    directory = _saved(tmp_path, state, (1, 2))
    for step in (1, 2):
        _flip_bytes(directory, step)
    with pytest.raises(checkpoint.CheckpointError, match=r"no usable checkpoint.*step 2: .*step 1"):
        _restore(directory, abstract)


def test_a_checkpoint_of_another_model_is_named_not_skipped(tiny, tmp_path):
    """Resuming with a changed model shape failed with its cause 500 lines up."""
    state, _ = tiny
    directory = _saved(tmp_path, state, (1,))
    wider = TINY.__class__(**{**TINY.__dict__, "intermediate_size": 48})
    _, abstract = _state_and_abstract(wider)
    with pytest.raises(
        checkpoint.CheckpointError,
        match=r"does not fit this run's state: .*down_proj/kernel saved \(1, 32, 16\) vs now \(1, 48, 16\)",
    ):
        _restore(directory, abstract)
    assert os.path.isdir(os.path.join(directory, "1"))  # not moved aside: it is not damaged


def test_a_save_that_cannot_be_written_raises_at_once_and_leaves_no_thread(tiny, tmp_path):
    """The hang: orbax created step directories asynchronously; when that failed, its
    commit threads waited five minutes for a signal that never came, and the interpreter
    waited for them at exit. Now the save raises, naming the directory, and nothing waits."""
    state, _ = tiny
    directory = tmp_path / "ckpt"
    before = {t.ident for t in threading.enumerate()}
    manager = checkpoint.make_manager(str(directory), async_save=True)
    checkpoint.save(manager, state.replace(step=1))
    checkpoint.finish(manager)
    shutil.rmtree(directory)
    directory.write_text("a file where the checkpoint directory was")
    start = time.monotonic()
    with pytest.raises(checkpoint.CheckpointError, match=rf"checkpoint 2 in {directory} failed"):
        checkpoint.save(manager, state.replace(step=2))
    manager.close()
    assert time.monotonic() - start < 30
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        left = [
            t.name
            for t in threading.enumerate()
            if t.ident not in before and t.is_alive() and not t.daemon
        ]
        if not left:
            break
        time.sleep(0.2)
    assert not left, left


@pytest.fixture
def orbax_filters_released():
    """A failed save keeps the orbax filters until the process ends (checkpoint.py); a test
    process goes on, so they are released after each test that fails a save."""
    yield
    checkpoint.orbax_logs.failure_seen = False
    checkpoint.release_process_hooks()


@pytest.fixture
def tiny_tmpfs(tmp_path):
    """A 1 MiB tmpfs (root only; skipped where mount is not permitted)."""
    with small_tmpfs(tmp_path / "tmpfs", "1m") as mount:
        yield mount


@pytest.mark.parametrize("disk", ["injected", "tmpfs"])
def test_a_full_disk_during_an_async_save_is_one_line_at_once_and_keeps_the_previous(
    tiny, tmp_path, disk, monkeypatch, caplog, request, orbax_filters_released
):
    """A full disk under an asynchronous save printed ~240 lines of orbax tracebacks (an
    ERROR log per background thread, "Event loop is closed" callbacks) before the error.
    Now `check` raises one line naming the directory and the cause within seconds, nothing
    else reaches the log above DEBUG, and the previous checkpoint restores. `injected`: the
    write path raises ENOSPC (runs anywhere); `tmpfs`: a real 1 MiB filesystem, filled."""
    state, abstract = tiny
    root = request.getfixturevalue("tiny_tmpfs") if disk == "tmpfs" else tmp_path
    directory = str(root / "ckpt")
    manager = checkpoint.make_manager(directory, async_save=True)
    checkpoint.save(manager, state.replace(step=1, data="d1"))
    checkpoint.finish(manager)
    if disk == "tmpfs":
        fill_disk(root)
    else:  # orbax's file writes of step 2 fail (its array writes' failures are not raised)
        real = abstract_path.Path.write_text

        def full(self, *args, **kwargs):
            if "2.orbax-checkpoint-tmp" in str(self):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return real(self, *args, **kwargs)

        monkeypatch.setattr(abstract_path.Path, "write_text", full)
    start = time.monotonic()
    with caplog.at_level(logging.DEBUG):
        with pytest.raises(checkpoint.CheckpointError) as failed:
            checkpoint.save(manager, state.replace(step=2, data="d2"))
            while time.monotonic() - start < 30:
                checkpoint.check(manager)
                time.sleep(0.05)
        try:
            checkpoint.close(manager)
        except checkpoint.CheckpointError:
            pass  # the same failure again; the run reports the first
    assert time.monotonic() - start < 30
    message = str(failed.value)
    assert directory in message and "OSError: [Errno 28] No space left on device" in message
    assert "\n" not in message and len(message) < 600, message
    loud = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not loud, [r.getMessage()[:200] for r in loud]
    if disk == "tmpfs":
        os.remove(root / "filler")
    restored = _restore(directory, abstract)
    assert restored.step == 1 and restored.data == "d1"


def test_an_unretrieved_task_error_of_a_failed_write_is_held_back(tmp_path, orbax_filters_released):
    """CI saw the full-disk run end with one line, then asyncio's "Task exception was never
    retrieved" and a tensorstore traceback: the garbage collector finalised a failed
    write's task after `check` had raised, and asyncio logs that on its own logger, which
    the filter did not cover. Records naming a manager's directory go to DEBUG; others stay."""
    directory = str(tmp_path / "ckpt")
    manager = checkpoint.make_manager(directory, async_save=True)
    seen = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    handler = Keep(logging.ERROR)
    logging.getLogger().addHandler(handler)
    try:
        ours = f"Task exception was never retrieved\nexception=ValueError('{directory}/2.tmp')"
        logging.getLogger("asyncio").error(ours)
        logging.getLogger("asyncio").error("Task exception was never retrieved: elsewhere")
    finally:
        logging.getLogger().removeHandler(handler)
        manager.close()
    assert seen == ["Task exception was never retrieved: elsewhere"], seen


def test_a_save_that_never_returns_stops_the_run_within_the_timeout(
    tiny, tmp_path, monkeypatch, orbax_filters_released
):
    """A filesystem that stops answering left the run waiting for good: `check` saw no
    error, and the next `save` / `finish` / the manager's close waited for the write. Now
    `check` raises once the write is older than checkpoint.save_timeout_s, and nothing
    waits for that manager again; the previous checkpoint is intact."""
    state, abstract = tiny
    directory = str(tmp_path / "ckpt")
    manager = checkpoint.make_manager(directory, async_save=True)
    checkpoint.save(manager, state.replace(step=1, data="d1"))
    checkpoint.finish(manager)
    answer = threading.Event()
    real = abstract_path.Path.write_text

    def never_returns(self, *args, **kwargs):
        if "2.orbax-checkpoint-tmp" in str(self):
            # The filesystem stopped answering. Orbax's metadata write holds a lock that its
            # `check_for_errors` waits for: that wait was the run's silent hang.
            answer.wait()
        return real(self, *args, **kwargs)

    monkeypatch.setattr(abstract_path.Path, "write_text", never_returns)
    manager.gspo_jax_saves.timeout_s = 2.0  # set after the first save: compiles are slow
    try:
        start = time.monotonic()
        checkpoint.save(manager, state.replace(step=2, data="d2"))
        with pytest.raises(checkpoint.CheckpointError) as stalled:
            while time.monotonic() - start < 60:
                checkpoint.check(manager)
                time.sleep(0.1)
        waited = time.monotonic() - start
        assert 2.0 <= waited < 15, waited
        assert str(stalled.value).startswith(
            f"saving checkpoint 2 in {directory} did not finish within 2 s "
            "(config.checkpoint.save_timeout_s)"
        )
        start = time.monotonic()
        for then in (
            lambda: checkpoint.save(manager, state.replace(step=3)),
            lambda: checkpoint.finish(manager),
        ):
            with pytest.raises(checkpoint.CheckpointError, match="not tried, an earlier save"):
                then()
        checkpoint.close(manager)  # returns: it does not wait for the stuck write
        assert time.monotonic() - start < 2
        restored = _restore(directory, abstract)  # while step 2 is still stuck
        assert restored.step == 1 and restored.data == "d1"
    finally:
        answer.set()  # let the stuck thread end, so it does not outlive the test
        manager.wait_until_finished()
        manager.close()


def test_digests_see_one_flipped_bit_and_not_the_sharding(tiny):
    state, _ = tiny
    params = state.train.params
    sharded = checkpoint.digests(params)
    whole = checkpoint.digests(jax.device_get(params))  # numpy, one device
    assert sharded == whole
    embedding = np.asarray(params["embed"]["embedding"]).copy()
    bits = embedding.view(np.uint32)
    bits[3, 5] ^= np.uint32(1 << 17)
    flipped = checkpoint.digests({"x": jnp.asarray(embedding)})["x"]
    original = checkpoint.digests({"x": params["embed"]["embedding"]})["x"]
    assert flipped[0] != original[0] and flipped[1] != original[1]
    bf16 = params["embed"]["embedding"].astype(jnp.bfloat16)
    assert checkpoint.digests({"x": bf16})["x"] != checkpoint.digests({"x": bf16 * 2})["x"]
    with pytest.raises(ValueError, match=r"the weights holds? NaN or inf in embed/embedding"):
        checkpoint.require_finite(
            {"embed": {"embedding": params["embed"]["embedding"].at[0, 0].set(jnp.nan)}},
            "the weights",
        )


def test_a_policy_holding_nan_is_never_exported(tiny, tmp_path):
    """A run must not leave a NaN model behind: `export_hf` names the tensor and writes
    nothing (it used to write an all-NaN model.safetensors, exit 0)."""
    state, _ = tiny
    params = state.train.params
    bad = {**params, "embed": {"embedding": params["embed"]["embedding"].at[1, 2].set(jnp.inf)}}
    path = tmp_path / "hf"
    with pytest.raises(ValueError, match=r"the final policy \(not exported to .*hf\) holds NaN "):
        checkpoint.export_hf(TINY, None, bad, str(path))
    assert not path.exists()


def test_an_export_leaves_no_file_of_another_model(tiny, tmp_path, caplog):
    """Exporting into an hf/ holding another model removed its stale safetensors but left
    pytorch_model.bin and vocab.json beside the new weights (a loader may pick them). Now
    the directory holds exactly what a fresh export writes, the others named in a warning."""
    from gspo_jax import data

    state, _ = tiny
    tokenizer = data.make_char_tokenizer(tmp_path / "tok")
    fresh = tmp_path / "fresh"
    checkpoint.export_hf(TINY, tokenizer, state.train.params, str(fresh))
    path = tmp_path / "hf"
    path.mkdir()
    for name in ("pytorch_model.bin", "vocab.json", "model-00001-of-00002.safetensors"):
        (path / name).write_bytes(b"another model")
    (path / "sub").mkdir()
    with caplog.at_level(logging.WARNING, logger="gspo_jax.trainer.io.checkpoint"):
        checkpoint.export_hf(TINY, tokenizer, state.train.params, str(path))
    logged = [r.getMessage() for r in caplog.records]
    assert sorted(os.listdir(path)) == sorted(os.listdir(fresh))
    assert not (tmp_path / "hf.partial").exists()
    assert any("pytorch_model.bin" in m and "vocab.json" in m for m in logged), logged
    _cfg, params = models.load_pretrained(path)
    np.testing.assert_array_equal(
        params["embed"]["embedding"], np.asarray(state.train.params["embed"]["embedding"])
    )


def test_orbax_task_reports_go_to_debug_and_others_stay():
    """After a failed save, asyncio's report of an orbax task nobody awaited (seen once in
    5 full-disk runs under load: the metadata store's write after the executor's shutdown)
    is held back like orbax's own ERROR records; any other task's report still shows."""
    import logging

    from gspo_jax.trainer.io import checkpoint as ckpt

    def record(name, text):
        return logging.LogRecord(name, logging.ERROR, "base_events.py", 1771, text, None, None)

    orbax_task = (
        "Task exception was never retrieved\nfuture: <Task finished name='Task-933' "
        "coro=<Store.write() done, defined at /venv/lib/python3.11/site-packages/orbax/"
        "checkpoint/_src/metadata/array_metadata_store.py:176> "
        "exception=RuntimeError('cannot schedule new futures after shutdown')>"
    )
    other_task = "Task exception was never retrieved\nfuture: <Task coro=<mine() at /w/x.py:1>>"
    assert not ckpt.orbax_logs.orbax_filter.filter(record("asyncio", orbax_task))
    assert ckpt.orbax_logs.orbax_filter.filter(record("asyncio", other_task))
    assert ckpt.orbax_logs.orbax_filter.filter(record("my.module", orbax_task))  # only asyncio's


def test_orbax_future_reports_go_to_debug_by_their_traceback():
    """asyncio's "Future exception was never retrieved" names no coroutine: the record is
    orbax's when its exception was raised in orbax's code (async_path's write on a full
    disk, seen once in a fresh clone's test run); a future failed elsewhere still shows."""
    import logging
    import sys

    from gspo_jax.trainer.io import checkpoint as ckpt

    def raised_in(filename):
        code = compile(
            "def write():\n    raise OSError(28, 'No space left on device')\n", filename, "exec"
        )
        space = {}
        exec(code, space)  # noqa: S102 (a function whose frames name orbax's file)
        try:
            space["write"]()
        except OSError:
            return sys.exc_info()

    text = "Future exception was never retrieved\nfuture: <Future finished exception=OSError(28)>"
    orbax = "/venv/site-packages/orbax/checkpoint/_src/path/async_path.py"
    for filename, shown in ((orbax, False), ("/work/mine.py", True)):
        record = logging.LogRecord(
            "asyncio", logging.ERROR, "base_events.py", 1771, text, None, raised_in(filename)
        )
        assert ckpt.orbax_logs.orbax_filter.filter(record) is shown, filename


def test_the_cause_of_an_error_chain_that_loops_is_found_not_looped_on():
    """Closing the manager after a save failed on a full disk raised an error whose
    context led back to itself; `_cause` walked that chain forever, holding the GIL, and
    the run hung instead of printing its one line (1 trial in 4 under load)."""
    disk = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/ckpt/2/state")
    wrapper = RuntimeError("the save failed")
    wrapper.__context__ = disk
    disk.__context__ = wrapper  # the cycle
    assert checkpoint._cause(wrapper) == (
        "OSError: [Errno 28] No space left on device: '/ckpt/2/state'"
    )
    # A cause beats a context, a suppressed context ends the chain, and a self-loop ends.
    outer = ValueError("outer")
    outer.__cause__, outer.__context__ = KeyError("k"), disk
    assert checkpoint._cause(outer) == "KeyError: 'k'"
    quiet = ValueError("quiet")
    quiet.__context__, quiet.__suppress_context__ = disk, True
    assert checkpoint._cause(quiet) == "ValueError: quiet"
    alone = ValueError("alone")
    alone.__context__ = alone
    assert checkpoint._cause(alone) == "ValueError: alone"
