"""Issue 42 (reliability, round three): rewards mean what they say, an interrupt is never a
verifier failure, no verifier input stalls a step (docs/failures.md)."""

import contextlib
import os
import signal
import threading
import time

import numpy as np
import pytest

from configs import default
from gspo_jax.config.validate import ConfigError, validate
from gspo_jax.rewards import answers, arith, math_rewards, registry, scoring
from gspo_jax.rewards.items import STATUS_ERROR, STATUS_NONFINITE, evaluate_item
from gspo_jax.rollout import filtering
from gspo_jax.trainer import loop, preemption

# ----------------------------------------------------------------- 5. rewards mean what they say


@pytest.mark.parametrize("spec", ["arith_exact:3", "arith_exact,arith_digits", "arith_exact:0.5"])
def test_a_weighted_or_summed_accuracy_reward_is_a_start_up_error(spec):
    # arith_exact:3 reported a held-out accuracy of 1.03 in summary.json.
    c = default.get_config()
    c.reward.accuracy = spec
    with pytest.raises(ConfigError, match=r"config.reward.accuracy=.*one 0/1 reward"):
        validate(c)
    c.reward.accuracy = "arith_exact:1.0"  # the same as the bare name
    validate(c)


def test_a_reward_spec_whose_weights_are_all_zero_is_an_error():
    c = default.get_config()
    c.reward.spec = "arith_exact:0,arith_digits:0"
    with pytest.raises(ConfigError, match=r"config.reward.spec=.*every weight is 0"):
        validate(c)


def test_a_reward_constant_over_the_first_steps_is_said_before_the_dead_group_warning():
    watch = filtering.DeadGroupWatch()  # the loop's: warns on dead groups after 5 steps
    constant = {"reward/frac_zero_std": 1.0, "reward/std": 0.0, "reward/mean": 0.0}
    said = [watch.after_step(step, constant) for step in (1, 2, 3)]
    assert said[0] is None and said[2] is None
    assert "RL step 2" in said[1] and "the reward was 0 for every response" in said[1]
    # The dead-group warning still comes at its own time.
    assert [watch.after_step(s, constant) for s in (4, 5)][-1] is not None
    # A batch-wide constant that changes value, or comes only later, is not "constant".
    watch = filtering.DeadGroupWatch()
    assert watch.after_step(1, constant) is None
    assert watch.after_step(2, constant | {"reward/mean": 1.0}) is None
    late = filtering.DeadGroupWatch()
    assert late.after_step(3, constant) is None and late.after_step(4, constant) is None


# --------------------------------------------- 8. a reward beyond float32 is named at the source


def test_a_reward_beyond_float32_counts_as_non_finite_and_names_the_reward():
    # 1e39 is finite in Python, inf in the float32 rewards: the run used to stop steps later
    # blaming kl_loss_coef, entropy_coef or the learning rate.
    def huge(prompt, completion, reference):
        return 1e39

    rewards, stats = scoring.score_batch(huge, ["p"], ["c"], ["r"], timeout_s=None)
    assert np.isfinite(rewards).all() and rewards[0] == 0.0
    assert stats["num_nonfinite"] == 1 and "float32" in stats["messages"][0]
    # A weighted sum that leaves float32's range is named as such.
    status, _, _, text = evaluate_item(
        registry.build_reward("arith_exact:1e39"), "", "#### 1", "#### 1"
    )
    assert status == STATUS_NONFINITE and "float32" in text


def test_a_re_run_keeps_the_runs_warm_start_origin_in_the_summary(tmp_path):
    first = {"origin": "scratch initialisation + warm start (target reached)", "start_step": 0}
    loop.write_summary(str(tmp_path), first)
    again = {"origin": "checkpoint 4 in /w/checkpoints", "start_step": 4}
    merged = loop.write_summary(str(tmp_path), again)
    assert merged["origin"] == first["origin"]
    assert merged["resumed_from"] == again["origin"]


# ------------------------------------------------ 3. an interrupt is never a verifier failure


def test_a_verifier_raising_keyboard_interrupt_is_a_verifier_error():
    def rude(prompt, completion, reference):
        raise KeyboardInterrupt

    status, _, _, text = evaluate_item(rude, "", "", "")
    assert status == STATUS_ERROR and "KeyboardInterrupt" in text


def _sender(signum: int, times: int, delay: float):
    def send():
        for _ in range(times):
            time.sleep(delay)
            os.kill(os.getpid(), signum)

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    return thread


def test_a_second_signal_stops_a_hung_in_process_verifier():
    # The second SIGTERM's SystemExit used to be caught as the verifier's failure, and the
    # hang went on (only SIGKILL ended it).
    def hangs(prompt, completion, reference):
        end = time.monotonic() + 10  # bounded, so a regression fails instead of hanging
        while time.monotonic() < end:
            time.sleep(0.01)
        return 1.0

    start = time.monotonic()
    with preemption.StopOnSignal():
        _sender(signal.SIGTERM, 2, 0.3)
        with pytest.raises(SystemExit) as stopped:
            scoring.score_batch(hangs, ["p"], ["c"], ["r"], timeout_s=None)
    assert stopped.value.code == 128 + signal.SIGTERM
    assert time.monotonic() - start < 5


def test_a_ctrl_c_during_in_process_scoring_is_an_interrupt_not_a_verifier_error():
    def slow(prompt, completion, reference):
        end = time.monotonic() + 10
        while time.monotonic() < end:
            time.sleep(0.01)
        return 1.0

    # Python's own Ctrl-C handler, whatever the suite inherited: a suite started in the
    # background (nohup, `&` in a script) begins with SIGINT ignored.
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        _sender(signal.SIGINT, 1, 0.3)
        with pytest.raises(KeyboardInterrupt):
            scoring.score_batch(slow, ["p"], ["c"], ["r"], timeout_s=None)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, inherited)


# ------------------------------------------------------- 4. no verifier input stalls a step


@pytest.mark.parametrize(
    "reward",
    [
        math_rewards.math_reward,
        math_rewards.math_strict_reward,
        math_rewards.boxed_format_reward,
        arith.arith_exact_reward,
        arith.arith_digits_reward,
    ],
)
def test_deeply_nested_boxes_are_scored_in_bounded_time(reward):
    # 5,000 nested \boxed{ (40 KB) took 13-58 s: quadratic unwrapping.
    depth = 5000
    text = "\\boxed{" * depth + "5" + "}" * depth
    start = time.perf_counter()
    reward("", text, "#### 5")
    reward("", "{" * 20000 + "x" + "}" * 20000, "#### 5")
    assert time.perf_counter() - start < 2.0
    # A few levels are still unwrapped.
    assert answers.extract_answer("\\boxed{\\boxed{\\fbox{5}}}") == "5"


def test_an_in_process_verifier_is_bounded_by_the_timeout():
    # reward.num_workers=0 had no time bound: a hanging verifier stalled the step.
    from gspo_jax.config import specs

    def hangs(prompt, completion, reference):
        end = time.monotonic() + 10
        while time.monotonic() < end:
            # A verifier swallowing every Exception cannot swallow the timeout.
            with contextlib.suppress(Exception):
                time.sleep(0.01)
        return 1.0

    start = time.monotonic()
    rewards, stats = scoring.score_batch(
        hangs, ["p", "q"], ["c", "d"], ["r", "s"], timeout_s=None, in_process_timeout_s=0.3
    )
    assert stats["num_timeouts"] == 2 and "timed out after 0.3 s" in stats["messages"][0]
    assert time.monotonic() - start < 5 and rewards.tolist() == [0.0, 0.0]
    c = default.get_config()
    c.reward.num_workers = 0
    model = specs.scratch_model_config(c, vocab_size=100, eos_token_ids=(2,), pad_token_id=0)
    spec = specs.from_config(c, model, reference_key="answer")
    assert spec.reward.in_process_timeout_s == c.reward.timeout_s


def test_a_worker_whose_parent_is_gone_exits_without_a_traceback():
    # Each worker of a dying pool printed its BrokenPipeError traceback (hundreds of lines
    # below the trainer's one-line error).
    import multiprocessing.connection
    import socket
    import subprocess
    import sys

    from gspo_jax.rewards import pool

    parent, child = socket.socketpair()
    worker = subprocess.Popen(
        [sys.executable, "-c", pool._BOOTSTRAP, str(child.fileno()), str(os.getpid())],
        pass_fds=(child.fileno(),),
        stdin=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    child.close()
    conn = multiprocessing.connection.Connection(parent.detach())
    conn.send(list(sys.path))
    assert conn.recv()[0] == "ready"
    reward = registry.build_reward("math")
    items = [(i, "p", "#### 1 " * 2000, "#### 1") for i in range(3000)]
    conn.send((reward.spec, reward.modules, items))
    conn.close()  # the parent is gone while the worker sends its results
    _, err = worker.communicate(timeout=120)
    assert "Traceback" not in err, err[-2000:]
