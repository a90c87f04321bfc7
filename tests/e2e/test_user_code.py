"""The recipe of docs/architecture.md ("A reward"), followed literally from a file outside
the repository: `--config.imports=my_rewards.py --config.reward.spec=my_reward`, scored by
a worker process that imports the file too."""

import json
import os
import shutil
import subprocess
import textwrap
from pathlib import Path

from helpers import TINY_RUN, main_command, metrics_by_step

RECIPE = '''
import gspo_jax.rewards


@gspo_jax.rewards.register_reward("my_reward")
def my_reward(prompt, completion, reference):
    """1 if the response ends with the reference answer, else 0."""
    return float(completion.strip().endswith(str(reference)))
'''


def test_a_reward_from_your_own_file_trains_through_main(tmp_path):
    mine = tmp_path / "elsewhere" / "my_rewards.py"
    mine.parent.mkdir()
    mine.write_text(textwrap.dedent(RECIPE))
    workdir = tmp_path / "run"
    flags = [
        f
        for f in TINY_RUN
        if not f.startswith(("--config.num_steps", "--config.reward.num_workers"))
    ]
    cmd = main_command(
        workdir,
        f"--config.data.data_dir={tmp_path / 'data'}",
        *flags,
        "--config.num_steps=2",
        "--config.reward.num_workers=1",
        f"--config.imports={mine}",
        "--config.reward.spec=my_reward",
    )
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = metrics_by_step(workdir)
    assert rows[2]["reward/num_errors"] == 0 and 0.0 <= rows[2]["reward/mean"] <= 1.0


def test_a_checkpoint_by_hub_id_from_the_cache_trains_through_main(tmp_path):
    """`--config.model.hf_path=org/name` with the checkpoint in a Hugging Face cache laid
    out locally (HF_HUB_CACHE): the run reads it from the snapshot, nothing is downloaded."""
    fixture = Path(__file__).resolve().parents[1] / "fixtures" / "models" / "default_warm_start"
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "cache" / "models--gspo-test--tiny"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    shutil.copytree(fixture, repo / "snapshots" / commit)
    flags = [f for f in TINY_RUN if not f.startswith(("--config.num_steps", "--config.model."))]
    cmd = main_command(
        tmp_path / "run",
        f"--config.data.data_dir={tmp_path / 'data'}",
        *flags,
        "--config.num_steps=1",
        "--config.model.hf_path=gspo-test/tiny",
    )
    env = dict(os.environ, HF_HUB_CACHE=str(tmp_path / "cache"), HF_HUB_OFFLINE="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = (tmp_path / "run" / "summary.json").read_text()
    assert f"snapshots/{commit}" in summary


FIELD_RECIPE = '''
import gspo_jax.rewards


@gspo_jax.rewards.register_reward("by_difficulty")
def by_difficulty(prompt, completion, reference, *, example):
    """The line's own "difficulty" field: the reward sees the example's other fields."""
    return float(example["difficulty"])
'''


def test_a_reward_reads_the_jsonl_lines_fields_through_main(tmp_path):
    """A JSONL file with a field beyond prompt / answer, and a reward from a file outside the
    repository that asks for it (`example=`), scored by a worker process: every response's
    reward is its line's field."""
    mine = tmp_path / "elsewhere" / "field_rewards.py"
    mine.parent.mkdir()
    mine.write_text(textwrap.dedent(FIELD_RECIPE))
    for split, count in (("train", 40), ("test", 8)):
        lines = [
            json.dumps({"q": f"{i} + {i} = ?", "a": 2 * i, "difficulty": 0.25})
            for i in range(count)
        ]
        (tmp_path / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
    flags = [
        f
        for f in TINY_RUN
        if not f.startswith(("--config.num_steps", "--config.reward.num_workers"))
    ]
    workdir = tmp_path / "run"
    cmd = main_command(
        workdir,
        f"--config.data.data_dir={tmp_path / 'data'}",
        *flags,
        "--config.num_steps=1",
        "--config.reward.num_workers=1",
        f"--config.imports={mine}",
        "--config.reward.spec=by_difficulty",
        "--config.data.name=jsonl",
        "--config.data.config_name=",
        f"--config.data.train_path={tmp_path / 'train.jsonl'}",
        f"--config.data.test_path={tmp_path / 'test.jsonl'}",
        "--config.data.prompt_key=q",
        "--config.data.answer_key=a",
    )
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    row = metrics_by_step(workdir)[1]
    assert row["reward/num_errors"] == 0 and row["reward/mean"] == 0.25, row


def test_a_saved_hf_dataset_with_a_plain_template_trains_through_main(tmp_path):
    """`data.name=hf` on a `datasets` save_to_disk directory (its validation split held
    out), asked as plain text (`data.chat_template=none`); nothing is downloaded."""
    import pyarrow as pa

    root = tmp_path / "my_dataset"
    for split, count in (("train", 40), ("validation", 8)):
        folder = root / split
        folder.mkdir(parents=True)
        rows = [{"question": f"{i} + {i} = ?", "answer": str(2 * i)} for i in range(count)]
        table = pa.Table.from_pylist(rows)
        sink = pa.OSFile(str(folder / "data-00000-of-00001.arrow"), "wb")
        with sink, pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
        state = {"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}
        (folder / "state.json").write_text(json.dumps(state))
    (root / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "validation"]}))
    flags = [f for f in TINY_RUN if not f.startswith("--config.num_steps")]
    workdir = tmp_path / "run"
    cmd = main_command(
        workdir,
        f"--config.data.data_dir={tmp_path / 'data'}",
        *flags,
        "--config.num_steps=1",
        "--config.data.name=hf",
        "--config.data.config_name=",
        f"--config.data.hf_path={root}",
        "--config.data.prompt_key=question",
        "--config.data.eval_split=validation",
        "--config.data.chat_template=none",
    )
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = metrics_by_step(workdir)
    assert rows[0]["eval/num_prompts"] == 8 and rows[1]["reward/num_errors"] == 0
