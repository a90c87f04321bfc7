"""The cached warm start (trainer/warm_cache.py): training it against reusing it.

Sets up configs/default.py twice in one temporary directory, a GSPO run then a GRPO-sized
clip range (another algorithm, the same warm-start key), and times `loop.init_or_restore`
of each: the first trains the supervised warm start and caches it, the second restores it.
Prints one JSON line: both times, their ratio, and each run's `origin`.

    python benchmarks/warm_cache.py
    python benchmarks/warm_cache.py --warm_start_steps=300

On a shared machine read the ratio (both timed in the same process), not seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax

from configs import default
from gspo_jax.trainer import loop, setup


def _timed_start(workdir: str, warm_start_steps: int | None, grpo: bool) -> tuple[float, str]:
    c = default.get_config()
    c.log.progress_bar = False
    c.data.data_dir = os.path.join(os.path.dirname(workdir), "data")
    if warm_start_steps is not None:
        c.warm_start.steps = warm_start_steps
        c.warm_start.target_accuracy = 0  # exactly that many steps
    if grpo:
        c.clip_low, c.clip_high = 0.2, 0.28
    trainer = setup.setup(c, workdir)
    try:
        with jax.set_mesh(trainer.mesh):
            t0 = time.perf_counter()
            state = loop.init_or_restore(trainer)
            jax.block_until_ready(state.train.params)
            return time.perf_counter() - t0, state.origin
    finally:
        trainer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--warm_start_steps", type=int, default=None, help="default: config's")
    parser.add_argument("--root", default=None, help="default: a temporary directory")
    args = parser.parse_args()
    root = args.root or tempfile.mkdtemp(prefix="warm_cache_")
    trained, origin_trained = _timed_start(os.path.join(root, "gspo"), args.warm_start_steps, False)
    reused, origin_reused = _timed_start(os.path.join(root, "grpo"), args.warm_start_steps, True)
    report = {
        "trained_s": round(trained, 2),
        "reused_s": round(reused, 2),
        "reused_over_trained": round(reused / trained, 4),
        "origin_trained": origin_trained,
        "origin_reused": origin_reused,
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
