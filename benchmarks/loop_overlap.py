"""What overlapping the loop's host work with the device would save (issue 15, item 4).

    python benchmarks/loop_overlap.py [--steps 14] [--config configs/default.py]

Runs the real loop's pieces (`setup.setup`, `rollouts.collect`, `loop.train_on`, the
reporter that writes metrics one step late) for `--steps` RL steps of the default run
(first two not counted: compiles) and splits each step's wall time into:

  sample, reward, train   the loop's own phase timings (time/*_s)
  other                   the rest of collect + rl_step: the data iterator, bucketing,
                          π_old dispatch, advantages, device_put of the batch
  logging                 writing the previous step's metrics (`_Reporter.step`)

Sampling step k+1 needs the params of train step k, which needs the rewards of step k, so
on-policy RL can overlap only `other` and `logging` with device work (dropping the
`block_until_ready` after the train step and letting the next step's host work run under
it). Their share of the step is the most that overlap could save.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

from configs import default
from gspo_jax.trainer import loop, setup


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=14)
    args = ap.parse_args()
    c = default.get_config()
    c.num_steps = 1000
    c.eval.every_steps = 0
    c.checkpoint.every_steps = 10_000
    c.log.progress_bar = False
    c.warm_start.steps = 0
    trainer = setup.setup(c, tempfile.mkdtemp(prefix="loop_overlap_"))
    state = loop.init_or_restore(trainer)
    report = loop._Reporter(trainer, initial=0)
    names = ("step", "sample", "reward", "train", "other", "logging")
    rows = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        prompts = next(trainer.train_iter)
        state = state.replace(data=json.dumps(trainer.train_iter.get_state()))
        state, m = loop.train_on(trainer, state, trainer.rollouts.collect(state, prompts))
        t1 = time.perf_counter()
        report.step(state.step, m)
        t2 = time.perf_counter()
        phases = m["time/sample_s"] + m["time/reward_s"] + m["time/train_s"]
        rows.append(
            (t2 - t0, m["time/sample_s"], m["time/reward_s"], m["time/train_s"], t1 - t0 - phases)
            + (t2 - t1,)
        )
    trainer.close()
    med = {k: statistics.median(r[i] for r in rows[2:]) for i, k in enumerate(names)}
    for key, value in med.items():
        print(f"{key:<8} {1e3 * value:8.2f} ms")
    share = (med["other"] + med["logging"]) / med["step"]
    print(f"overlappable host work / step: {share:.3f}")
    print(json.dumps({**med, "overlappable_share": share}))


if __name__ == "__main__":
    main()
