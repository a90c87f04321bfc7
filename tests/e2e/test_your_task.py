"""docs/your_task.md's twenty lines, run as written: `gspo_jax.train` with a plain reward
function and a list of dicts. Two changes, for time: `configs.default.get_config` gives the
test suite's tiny model and run (tests/helpers.py: TINY_RUN), and 2 RL steps instead of 20."""

import os
import re
from pathlib import Path

import pytest
from helpers import TINY_RUN, apply_flags, metrics_by_step

from configs import default

DOC = Path(__file__).resolve().parents[2] / "docs" / "your_task.md"


def _example() -> str:
    block = re.search(r"```python\n(.*?)```", DOC.read_text(), re.DOTALL).group(1)
    assert len(block.strip().splitlines()) <= 22, "the example is meant to be twenty lines"
    return block


def test_the_twenty_line_example_trains(tmp_path, monkeypatch, capsys):
    real = default.get_config

    def tiny():
        c = real()
        apply_flags(c, [f for f in TINY_RUN if not f.startswith("--config.num_steps")])
        c.reward.num_workers = 1  # train() must turn workers off: the reward is in __main__
        return c

    monkeypatch.setattr(default, "get_config", tiny)
    monkeypatch.chdir(tmp_path)
    code = _example().replace("config.num_steps = 20", "config.num_steps = 2")
    exec(compile(code, str(DOC), "exec"), {"__name__": "__main__"})  # noqa: S102 (the doc's code)
    start, _, end = capsys.readouterr().out.strip().splitlines()[-1].partition(" -> ")
    assert 0.0 <= float(start) <= 1.0 and 0.0 <= float(end) <= 1.0
    rows = (tmp_path / "workdirs/my_task/dataset/train.jsonl").read_text().splitlines()
    test = (tmp_path / "workdirs/my_task/dataset/test.jsonl").read_text().splitlines()
    assert (len(rows), len(test)) == (1800, 200)
    assert os.path.isdir(tmp_path / "workdirs/my_task/hf")


def test_a_bad_dataset_or_reward_is_named(tmp_path):
    import gspo_jax

    with pytest.raises(ValueError, match="named function"):
        gspo_jax.train(default.get_config(), str(tmp_path), reward_fns=[lambda p, c, r: 1.0])
    with pytest.raises(TypeError, match=r"dataset\['train'\]\[1\] is str, not a dict"):
        gspo_jax.train(
            default.get_config(), str(tmp_path), dataset={"train": [{}, "x"], "test": []}
        )


def test_a_plain_function_reads_each_dicts_other_fields(tmp_path):
    """`gspo_jax.train(reward_fns=[f], dataset=[...])` with `f(..., *, example)`: the
    function, scored in-process, gets each dict's own fields (here a per-problem weight)."""
    import gspo_jax

    seen = []

    def weighted(prompt, completion, reference, *, example):
        seen.append(example["weight"])
        return float(example["weight"])

    config = default.get_config()
    apply_flags(config, [f for f in TINY_RUN if not f.startswith("--config.num_steps")])
    config.num_steps = 1
    config.data.data_dir = str(tmp_path / "data")
    problems = [{"prompt": f"{i} + 1 = ?", "answer": i + 1, "weight": 0.5} for i in range(40)]
    gspo_jax.train(config, str(tmp_path / "run"), reward_fns=[weighted], dataset=problems)
    assert seen and set(seen) == {0.5}
    row = metrics_by_step(tmp_path / "run")[1]
    assert row["reward/mean"] == 0.5 and row["reward/num_errors"] == 0
