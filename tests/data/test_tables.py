"""data.name="parquet" and "hf": Parquet files, `datasets` save_to_disk directories, Parquet
directories and Hub ids in a local cache, through the real TFDS path, keys mapped as for
JSONL, errors naming the path; nothing is downloaded."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from configs import default
from gspo_jax import data
from gspo_jax.config.validate import ConfigError, validate
from gspo_jax.data import tables

ROWS = [
    {"q": f"What is {i} + 1?", "sol": i + 1, "level": i % 3, "tags": ["a", str(i)]}
    for i in range(5)
]


def _parquet(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def _arrow_split(folder, rows):
    """One split as `datasets`' save_to_disk writes it: an Arrow stream file and state.json."""
    folder.mkdir(parents=True)
    table = pa.Table.from_pylist(rows)
    sink = pa.OSFile(str(folder / "data-00000-of-00001.arrow"), "wb")
    with sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    state = {"_data_files": [{"filename": "data-00000-of-00001.arrow"}], "_split": None}
    (folder / "state.json").write_text(json.dumps(state))
    (folder / "dataset_info.json").write_text("{}")


def _records(sources, split):
    return [data.decode_record(sources[split][i]) for i in range(len(sources[split]))]


def test_parquet_files_with_custom_keys(tmp_path):
    train = _parquet(tmp_path / "train.parquet", ROWS)
    test = _parquet(tmp_path / "test.parquet", ROWS[:2])
    config = data.jsonl_config(train, test, "q", "sol")
    sources = data.build_dataset("parquet", config, data_dir=tmp_path / "tfds")
    records = _records(sources, "train")
    assert sorted(r["answer"] for r in records) == ["1", "2", "3", "4", "5"]
    row = json.loads(next(r for r in records if r["answer"] == "3")["example"])
    assert row == {"q": "What is 2 + 1?", "sol": 3, "level": 2, "tags": ["a", "2"]}
    assert len(sources["test"]) == 2


def test_a_save_to_disk_directory(tmp_path):
    root = tmp_path / "my_dataset"
    _arrow_split(root / "train", ROWS)
    _arrow_split(root / "validation", ROWS[:2])
    (root / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "validation"]}))
    config = data.hf_config(str(root), "q", "sol")
    sources = data.build_dataset(
        "hf", config, data_dir=tmp_path / "tfds", splits=("train", "validation")
    )
    assert len(sources["train"]) == 5 and len(sources["validation"]) == 2
    assert json.loads(_records(sources, "validation")[1]["example"])["level"] == 1


def test_a_parquet_directory_in_the_hub_layout_and_by_id_from_the_cache(tmp_path, monkeypatch):
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "cache" / "datasets--org--probs"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    _parquet(snapshot / "data" / "train-00000-of-00001.parquet", ROWS)
    _parquet(snapshot / "data" / "test-00000-of-00001.parquet", ROWS[:1])
    assert set(tables.hf_split_files(str(snapshot))) == {"train", "test"}
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    files = tables.hf_split_files("org/probs")
    assert [p.rsplit("/", 1)[1] for p in files["train"]] == ["train-00000-of-00001.parquet"]
    # A subset: one folder of the snapshot read alone (openai/gsm8k/main).
    _parquet(snapshot / "other" / "train-00000-of-00001.parquet", ROWS[:2])
    assert len(tables.hf_split_files("org/probs")["train"]) == 2
    alone = tables.hf_split_files("org/probs/other")
    assert [p.rsplit("/", 2)[1] for p in alone["train"]] == ["other"]
    with pytest.raises(FileNotFoundError, match=r"org/probs has no folder nope"):
        tables.hf_split_files("org/probs/nope")
    with pytest.raises(
        FileNotFoundError, match=r"org/other.*holds no snapshot.*--repo-type dataset org/other"
    ):
        tables.hf_split_files("org/other")


def test_folders_named_by_split_and_files_named_by_split(tmp_path):
    _parquet(tmp_path / "d" / "default" / "train" / "0000.parquet", ROWS)
    _parquet(tmp_path / "d" / "default" / "test" / "0000.parquet", ROWS)
    assert set(tables.hf_split_files(str(tmp_path / "d"))) == {"train", "test"}
    _parquet(tmp_path / "g" / "main" / "train-00000-of-00001.parquet", ROWS)
    _parquet(tmp_path / "g" / "main" / "test-00000-of-00001.parquet", ROWS)
    assert set(tables.hf_split_files(str(tmp_path / "g"))) == {"train", "test"}


def test_bad_tables_are_named(tmp_path):
    bad = tmp_path / "train.parquet"
    bad.write_bytes(b"not parquet")
    with pytest.raises(ValueError, match=r"train.parquet: cannot be read as a table"):
        data.jsonl.read_examples(str(bad), "train", "q", "sol")
    _parquet(bad, [{"q": "x", "other": 1}])
    with pytest.raises(ValueError, match=r"train.parquet: row 0: no key 'sol' \(data.answer_key\)"):
        data.jsonl.read_examples(str(bad), "train", "q", "sol")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"holds no dataset"):
        tables.hf_split_files(str(tmp_path / "empty"))
    with pytest.raises(FileNotFoundError, match=r"no such directory"):
        tables.hf_split_files(str(tmp_path / "not here"))


def test_validation_names_the_field(tmp_path):
    c = default.get_config()
    c.data.name, c.data.config_name = "hf", ""
    with pytest.raises(ConfigError, match=r'config.data.name="hf" needs config.data.hf_path'):
        validate(c)
    c.data.name = "parquet"
    c.data.train_path = c.data.test_path = str(_write_text(tmp_path / "t.jsonl"))
    with pytest.raises(ConfigError, match=r"config.data.train_path=.*ends in .parquet"):
        validate(c)


def _write_text(path):
    path.write_text("{}\n")
    return path
