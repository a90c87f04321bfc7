"""Tests for gspo_jax.data: builders, tokenizer, prompt and SFT pipelines."""

import json
import os
import re

import numpy as np
import pytest

from gspo_jax import data
from gspo_jax.data import arithmetic

QUESTION_RE = re.compile(r"^What is (\d+) ([+\-*]) (\d+)\?$")

# Small custom config so preparing the training split stays fast.
SMALL = data.ArithmeticConfig(
    name="small", ops=("+", "-", "*"), digits=(2, 2, 2), num_train=600, num_test=120, seed=7
)


def _records(source):
    return [data.decode_record(r) for r in source.__getitems__(list(range(len(source))))]


def _evaluate(question):
    a, op, b = QUESTION_RE.match(question).groups()
    a, b = int(a), int(b)
    return {"+": a + b, "-": a - b, "*": a * b}[op]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("tfds")


@pytest.fixture(scope="module")
def add2(data_dir):
    return data.build_dataset("arithmetic", "add2", data_dir=data_dir)


@pytest.fixture(scope="module")
def small(data_dir):
    return data.build_dataset("arithmetic", SMALL, data_dir=data_dir)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return data.make_char_tokenizer(tmp_path_factory.mktemp("tok") / "char")


@pytest.fixture(scope="module")
def small_prompts(small, tokenizer):
    return data.prepare_prompts(
        small["train"], tokenizer, prompt_length=64, instruction=None, shard_index=0, shard_count=1
    )


# ---------------------------------------------------------------- synthetic builder


def test_add2_splits_features_and_answers(add2):
    train, test = _records(add2["train"]), _records(add2["test"])
    assert (len(train), len(test)) == (9500, 500)
    for r in train[:50] + test[:50]:
        assert set(r) == {"id", "question", "answer"}
        assert all(isinstance(v, str) for v in r.values())
        assert int(r["answer"]) == _evaluate(r["question"])
        a, op, b = QUESTION_RE.match(r["question"]).groups()
        assert op == "+" and int(a) < 100 and int(b) < 100
    train_q = {r["question"] for r in train}
    test_q = {r["question"] for r in test}
    assert not train_q & test_q
    # add2 enumerates its whole pool: every (a, b) in [0, 99]^2 exactly once.
    assert len(train_q | test_q) == 10_000
    assert len({r["id"] for r in train + test}) == 10_000


def test_a_dev_split_is_a_slice_of_train_disjoint_from_the_rest(add2, data_dir):
    """'train[:500]' / 'train[500:]' (the experiment's --dev): the first 500 train records
    and the other 9,000, in train's order; a slice that does not parse names itself."""
    got = data.build_dataset(
        "arithmetic", "add2", data_dir=data_dir, splits=("train[:500]", "train[500:]")
    )
    dev, rest = _records(got["train[:500]"]), _records(got["train[500:]"])
    assert [r["id"] for r in dev + rest] == [r["id"] for r in _records(add2["train"])]
    assert (len(dev), len(rest)) == (500, 9000)
    assert not {r["question"] for r in dev} & {r["question"] for r in rest}
    with pytest.raises(ValueError, match=r"split 'train\[x\]' is not a valid slice"):
        data.build_dataset("arithmetic", "add2", data_dir=data_dir, splits=("train[x]",))
    with pytest.raises(ValueError, match=r"no split\(s\) \['dev\[:5\]'\]"):
        data.build_dataset("arithmetic", "add2", data_dir=data_dir, splits=("dev[:5]",))


def test_build_is_deterministic_and_idempotent(add2, data_dir, tmp_path):
    again = data.build_dataset("arithmetic", "add2", data_dir=tmp_path)
    for split in ("train", "test"):
        assert _records(again[split]) == _records(add2[split])
    variant = os.path.join(data_dir, "synthetic_arithmetic", "add2", "1.0.0")
    files = sorted(os.listdir(variant))
    mtimes = [os.path.getmtime(os.path.join(variant, f)) for f in files]
    data.build_dataset("arithmetic", "add2", data_dir=data_dir)
    assert sorted(os.listdir(variant)) == files
    assert [os.path.getmtime(os.path.join(variant, f)) for f in files] == mtimes


def test_generate_problems_mixed():
    config = next(c for c in data.ARITHMETIC_CONFIGS if c.name == "mixed")
    problems = data.generate_problems(config)
    assert len(problems) == config.num_train + config.num_test == 20_500
    assert len({p["question"] for p in problems}) == len(problems)
    ops = {"+": 0, "-": 0, "*": 0}
    for p in problems:
        a, op, b = QUESTION_RE.match(p["question"]).groups()
        ops[op] += 1
        assert int(p["answer"]) == _evaluate(p["question"]) >= 0
        assert int(a) < (100 if op == "*" else 1000) and int(b) < (100 if op == "*" else 1000)
    # Ops are drawn uniformly: each near 1/3 (binomial std ~ 67 examples).
    assert all(abs(n - len(problems) / 3) < 400 for n in ops.values()), ops
    assert data.generate_problems(config) == problems


def test_subtraction_pool_is_a_bijection():
    a, b = arithmetic._decode_pairs("-", 2, np.arange(arithmetic._pool_size("-", 2)))
    pairs = set(zip(a.tolist(), b.tolist()))
    assert pairs == {(x, y) for x in range(100) for y in range(x + 1)}


def test_config_errors():
    with pytest.raises(ValueError, match="only 100 distinct"):
        data.generate_problems(data.ArithmeticConfig(name="t", digits=(1,), num_train=100))
    with pytest.raises(ValueError, match="unknown op '/'"):
        data.generate_problems(data.ArithmeticConfig(name="t", ops=("/",), digits=(2,)))
    with pytest.raises(ValueError, match="unknown dataset"):
        data.build_dataset("nope", data_dir="/tmp/unused")
    with pytest.raises(ValueError, match="Unknown config 'add9'"):
        data.build_dataset("arithmetic", "add9", data_dir="/tmp/unused")


def test_prepare_false_on_unbuilt_dataset_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="not prepared"):
        data.build_dataset("arithmetic", "add3", data_dir=tmp_path, prepare=False)


def test_decode_record_bytes_to_str():
    record = {"a": b"x\xc3\xa9", "b": np.array(b"y"), "c": np.int64(3), "d": "z"}
    assert data.decode_record(record) == {"a": "xé", "b": "y", "c": 3, "d": "z"}


# ---------------------------------------------------------------- GSM8K builder


def _write_gsm8k(manual_dir, train_lines, test_lines):
    os.makedirs(manual_dir, exist_ok=True)
    for name, lines in (("train.jsonl", train_lines), ("test.jsonl", test_lines)):
        if lines is not None:
            with open(os.path.join(manual_dir, name), "w") as f:
                f.writelines(json.dumps(x) + "\n" for x in lines)


GSM_TRAIN = [
    {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3+4=<<3+4=7>>7\n#### 7"},
    {"question": "A car costs 1,000 twice. Total?", "answer": "2*1000=2000\n#### 2,000"},
    {"question": "Half of 9?", "answer": "9/2=4.5\n####  4.5 "},
]
GSM_TEST = [{"question": "What is 5 less than 12?", "answer": "12-5=7\n#### 7"}]


def test_gsm8k_builds_from_manual_dir(tmp_path, tokenizer):
    manual = tmp_path / "manual"
    _write_gsm8k(manual, GSM_TRAIN, GSM_TEST)
    sources = data.build_dataset("gsm8k", data_dir=tmp_path / "tfds", manual_dir=manual)
    train = sorted(_records(sources["train"]), key=lambda r: r["id"])
    assert [r["id"] for r in train] == ["train-00000", "train-00001", "train-00002"]
    assert [r["final_answer"] for r in train] == ["7", "2000", "4.5"]
    assert [r["question"] for r in train] == [x["question"] for x in GSM_TRAIN]
    assert [r["answer"] for r in train] == [x["answer"] for x in GSM_TRAIN]
    assert _records(sources["test"]) == [{"id": "test-00000", **GSM_TEST[0], "final_answer": "7"}]
    # Reused without the manual dir once prepared.
    again = data.build_dataset("gsm8k", data_dir=tmp_path / "tfds")
    assert len(again["train"]) == 3
    # The reference of a GSM8K prompt batch is the final answer.
    spec = data.get_spec("gsm8k")
    batch = next(
        data.make_prompt_iterator(
            sources["train"],
            tokenizer,
            batch_size=3,
            prompt_length=128,
            train=False,
            reference_key=spec.reference_key,
            shard_index=0,
            shard_count=1,
        )
    )
    by_id = {r["id"]: r["final_answer"] for r in train}
    assert [by_id[i] for i in batch["example_id"]] == list(batch["reference"])


def test_gsm8k_missing_file_is_named(tmp_path):
    manual = tmp_path / "manual"
    _write_gsm8k(manual, GSM_TRAIN, None)
    with pytest.raises(FileNotFoundError, match=r"test\.jsonl.*Expected layout"):
        data.build_dataset("gsm8k", data_dir=tmp_path / "tfds", manual_dir=manual)
    with pytest.raises(FileNotFoundError, match="needs manual_dir"):
        data.build_dataset("gsm8k", data_dir=tmp_path / "tfds")
    # The builder itself (used without build_dataset) gives the same error.
    import tensorflow_datasets as tfds

    builder = data.get_builder("gsm8k", data_dir=tmp_path / "tfds2")
    with pytest.raises(FileNotFoundError, match=r"test\.jsonl"):
        builder.download_and_prepare(
            download_config=tfds.download.DownloadConfig(manual_dir=os.fspath(manual))
        )


def test_gsm8k_bad_line_names_file_and_line(tmp_path):
    manual = tmp_path / "manual"
    _write_gsm8k(manual, GSM_TRAIN + [{"question": "q", "answer": "no marker"}], GSM_TEST)
    with pytest.raises(ValueError, match=r"train\.jsonl:4: .*no '####'"):
        data.read_gsm8k_jsonl(manual / "train.jsonl", "train")


def test_gsm8k_answer_that_is_not_a_number_names_file_and_line(tmp_path):
    """ "#### forty two" was accepted: a reference no completion could ever match."""
    manual = tmp_path / "manual"
    _write_gsm8k(manual, GSM_TRAIN + [{"question": "q", "answer": "so\n#### forty two"}], GSM_TEST)
    with pytest.raises(ValueError, match=r"train\.jsonl:4: .*'forty two' is not a number"):
        data.read_gsm8k_jsonl(manual / "train.jsonl", "train")


def test_gsm8k_empty_file_is_named(tmp_path):
    """An empty train.jsonl failed with TFDS's "No examples were yielded", no file named."""
    manual = tmp_path / "manual"
    _write_gsm8k(manual, GSM_TRAIN, GSM_TEST)
    (manual / "train.jsonl").write_text("")
    with pytest.raises(FileNotFoundError, match=r"empty: .*train\.jsonl"):
        data.check_gsm8k_manual_dir(manual)
    (manual / "train.jsonl").write_text("\n\n")
    with pytest.raises(ValueError, match=r"train\.jsonl: no GSM8K example"):
        data.read_gsm8k_jsonl(manual / "train.jsonl", "train")


def test_a_data_dir_prepared_from_other_manual_files_is_an_error(tmp_path):
    """Two runs sharing data.data_dir with different manual_dir: the second trained on the
    first run's cached data, without a word."""
    first, second = tmp_path / "first", tmp_path / "second"
    _write_gsm8k(first, GSM_TRAIN, GSM_TEST)
    _write_gsm8k(second, GSM_TRAIN[:2], GSM_TEST)
    data.build_dataset("gsm8k", data_dir=tmp_path / "tfds", manual_dir=first)
    copy = tmp_path / "copy"  # the same files elsewhere: the same data, no error
    _write_gsm8k(copy, GSM_TRAIN, GSM_TEST)
    assert (
        len(data.build_dataset("gsm8k", data_dir=tmp_path / "tfds", manual_dir=copy)["train"]) == 3
    )
    with pytest.raises(ValueError, match=rf"built from {first}, whose train.jsonl differ"):
        data.build_dataset("gsm8k", data_dir=tmp_path / "tfds", manual_dir=second)


# ---------------------------------------------------------------- tokenizer


def test_char_tokenizer_round_trip_and_ids(tokenizer):
    text = "What is 47 + 385?\nGive the final answer after ####. (x*y) - 3/4 = {z}!"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text)  # One token per character.
    assert tokenizer.decode(ids) == text
    assert len(tokenizer) == 100  # < 128: keeps the default model tiny.
    assert (tokenizer.pad_token, tokenizer.pad_token_id) == ("<|endoftext|>", 0)
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("<|im_end|>", 2)
    assert tokenizer.convert_tokens_to_ids("<|im_start|>") == 1
    assert data.stop_token_ids(tokenizer) == (2, 0)
    # Special tokens are single ids; unknown characters map to <|unk|>.
    assert tokenizer("<|im_start|>7<|im_end|>é", add_special_tokens=False)["input_ids"] == [
        1,
        tokenizer.convert_tokens_to_ids("7"),
        2,
        3,
    ]


def test_chat_template(tokenizer):
    messages = data.build_messages("What is 1 + 2?", system_prompt="Be exact.")
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe exact.<|im_end|>\n"
        "<|im_start|>user\nWhat is 1 + 2?\nGive the final answer after ####.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert data.render_prompt(tokenizer, "Q", instruction=None) == (
        "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n"
    )


def test_load_tokenizer_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        data.load_tokenizer(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="neither tokenizer.json"):
        data.load_tokenizer(tmp_path)


# ---------------------------------------------------------------- prompt pipeline


def test_prompt_batch_layout_matches_tokenizer(small, tokenizer):
    records = {r["id"]: r for r in _records(small["test"])}
    it = data.make_prompt_iterator(
        small["test"],
        tokenizer,
        batch_size=8,
        prompt_length=96,
        seed=3,
        system_prompt="Be exact.",
        shard_index=0,
        shard_count=1,
    )
    batch = next(it)
    assert batch["prompt_tokens"].dtype == np.int32 and batch["prompt_tokens"].shape == (8, 96)
    assert batch["prompt_mask"].dtype == np.int32 and batch["prompt_mask"].shape == (8, 96)
    for key in ("prompt_text", "question", "reference", "example_id"):
        assert batch[key].shape == (8,) and isinstance(batch[key][0], str)
    np.testing.assert_array_equal(batch["valid"], np.ones(8, np.int32))
    for n in range(8):
        record = records[batch["example_id"][n]]
        messages = data.build_messages(record["question"], system_prompt="Be exact.")
        expected = tokenizer.apply_chat_template(
            messages, tokenize=True, add_generation_prompt=True
        )["input_ids"]
        length = len(expected)
        mask = batch["prompt_mask"][n]
        # Left padding: zeros then ones, pad id under the zeros.
        np.testing.assert_array_equal(mask, [0] * (96 - length) + [1] * length)
        assert (batch["prompt_tokens"][n, : 96 - length] == tokenizer.pad_token_id).all()
        assert batch["prompt_tokens"][n, 96 - length :].tolist() == list(expected)
        assert batch["prompt_text"][n] == tokenizer.decode(expected)
        assert batch["reference"][n] == record["answer"]
        assert batch["question"][n] == record["question"]


def _ids(iterator, num_batches):
    return [list(next(iterator)["example_id"]) for _ in range(num_batches)]


def test_order_depends_only_on_seed(small_prompts):
    first = _ids(small_prompts.iterator(16, seed=1), 5)
    assert _ids(small_prompts.iterator(16, seed=1), 5) == first
    assert _ids(small_prompts.iterator(16, seed=2), 5) != first


def test_each_epoch_is_a_fresh_permutation(small_prompts):
    num_examples = small_prompts.num_examples  # 600 = 25 batches of 24.
    it = small_prompts.iterator(24, seed=0)
    epochs = [[i for b in _ids(it, num_examples // 24) for i in b] for _ in range(3)]
    everything = sorted(small_prompts.arrays["example_id"].tolist())
    for epoch in epochs:
        assert sorted(epoch) == everything
    assert epochs[0] != epochs[1] != epochs[2]
    assert it.epoch == 3.0


def test_resume_reproduces_batches(small, small_prompts, tokenizer):
    it = small_prompts.iterator(7, seed=5)
    for _ in range(90):  # Past one epoch (600 / 7 ~ 86 batches): state spans the boundary.
        next(it)
    state = json.loads(json.dumps(it.get_state()))
    expected = [next(it) for _ in range(5)]
    # A new process prepares the data from scratch and restores the saved position.
    fresh = data.prepare_prompts(
        small["train"], tokenizer, prompt_length=64, instruction=None, shard_index=0, shard_count=1
    ).iterator(7, seed=5)
    fresh.set_state(state)
    for want in expected:
        got = next(fresh)
        assert got.keys() == want.keys()
        for key in want:
            np.testing.assert_array_equal(got[key], want[key])
    assert fresh.epoch == it.epoch
    with pytest.raises(ValueError, match="seed: saved 5 vs now 6"):
        small_prompts.iterator(7, seed=6).set_state(state)
    other = data.prepare_prompts(
        small["train"], tokenizer, prompt_length=65, instruction=None, shard_index=0, shard_count=1
    )
    with pytest.raises(ValueError, match="fingerprint"):
        other.iterator(7, seed=5).set_state(state)


def test_process_shards_are_disjoint_and_cover(small, tokenizer):
    everything = {r["id"] for r in _records(small["test"])}  # 120 examples
    seen, num_batches = [], set()
    for index in range(3):
        prepared = data.prepare_prompts(
            small["test"], tokenizer, prompt_length=80, shard_index=index, shard_count=3
        )
        it = prepared.iterator(16, train=False)
        batches = list(it)
        num_batches.add(len(batches))
        assert len(batches) == it.num_batches
        seen += [i for b in batches for i, v in zip(b["example_id"], b["valid"]) if v]
        # Training shards hold the same examples as evaluation shards.
        assert set(prepared.arrays["example_id"]) == set(seen[-prepared.num_examples :])
    assert num_batches == {3}  # ceil(ceil(120 / 3) / 16) on every process.
    assert len(seen) == len(set(seen)) and set(seen) == everything


def _blocks(batch_size, count):
    """Process p's rows of a global batch: [p·n/P, (p+1)·n/P) (sharding.process_rows on a
    data-parallel mesh whose devices are grouped by process)."""
    size = batch_size // count
    return [np.arange(p * size, (p + 1) * size) for p in range(count)]


@pytest.mark.parametrize("count", [2, 4])
def test_row_shards_split_the_same_global_batches(small_prompts, count):
    """Every process iterates the same global batches and keeps its rows: their union is the
    one-process batch, whatever the process count, and a position saved by `count`
    processes resumes on one process (and back) at the same global batch."""
    whole = small_prompts.iterator(16, seed=3)
    parts = [small_prompts.iterator(16, seed=3, rows=rows) for rows in _blocks(16, count)]
    for _ in range(40):  # past one epoch of 600 / 16 batches
        want = next(whole)
        got = [next(it) for it in parts]
        for key in want:
            np.testing.assert_array_equal(np.concatenate([b[key] for b in got]), want[key])
    saved = json.loads(json.dumps(parts[0].get_state()))
    assert all(it.get_state() == saved for it in parts) and saved == whole.get_state()
    assert parts[0].epoch == whole.epoch == 40 * 16 / 600
    one = small_prompts.iterator(16, seed=3)
    one.set_state(saved)
    again = small_prompts.iterator(16, seed=3, rows=_blocks(16, count)[1])
    again.set_state(whole.get_state())
    for _ in range(3):
        want = next(whole)
        np.testing.assert_array_equal(next(one)["example_id"], want["example_id"])
        np.testing.assert_array_equal(
            next(again)["example_id"], want["example_id"][_blocks(16, count)[1]]
        )
    # Evaluation: one ordered pass, each process its rows of every padded global batch.
    halves = [list(small_prompts.iterator(64, train=False, rows=r)) for r in _blocks(64, 2)]
    assert [len(h) for h in halves] == [10, 10]  # ceil(600 / 64); the last has 24 real rows
    assert int(halves[1][-1]["valid"].sum()) == 0
    rows = [r for pair in zip(*halves) for b in pair for r in zip(b["example_id"], b["valid"])]
    assert [i for i, v in rows if v] == small_prompts.arrays["example_id"].tolist()


def test_row_shard_errors(small, tokenizer, small_prompts):
    for rows in ([], [0, 0], [16], [-1], [[0, 1]], [0.5]):
        with pytest.raises(ValueError, match="rows must be distinct int indices"):
            small_prompts.iterator(16, rows=rows)
    shard = data.prepare_prompts(
        small["test"], tokenizer, prompt_length=80, shard_index=1, shard_count=2
    )
    with pytest.raises(ValueError, match="already one of 2 record shards"):
        shard.iterator(8, rows=[0, 1, 2, 3])


def test_eval_is_one_ordered_pass_with_padding(small, tokenizer):
    prepared = data.prepare_prompts(
        small["test"], tokenizer, prompt_length=80, shard_index=0, shard_count=1
    )
    batches = list(prepared.iterator(50, train=False))  # 120 = 50 + 50 + 20 (+ 30 padding)
    assert [len(b["valid"]) for b in batches] == [50, 50, 50]
    assert [int(b["valid"].sum()) for b in batches] == [50, 50, 20]
    ids = [i for b in batches for i, v in zip(b["example_id"], b["valid"]) if v]
    assert ids == prepared.arrays["example_id"].tolist()
    # Padding rows repeat the last example (never an all-masked row).
    assert (batches[-1]["prompt_mask"][20:].sum(axis=1) > 0).all()
    assert next(prepared.iterator(50, train=False))["example_id"].tolist() == ids[:50]


def test_overlong_policy(small, tokenizer):
    records = _records(small["test"])
    lengths = [
        len(tokenizer(data.render_prompt(tokenizer, r["question"]))["input_ids"]) for r in records
    ]
    limit = max(lengths) - 1
    too_long = sum(n > limit for n in lengths)
    assert 0 < too_long < len(records)
    with pytest.raises(  # the fix names a config field (it said: "pass overlong='drop'")
        ValueError,
        match=rf"{too_long} of {len(records)} examples .*longest: {max(lengths)} tokens.*"
        r"config.prompt_length.*config.data.overlong='drop'",
    ):
        data.prepare_prompts(
            small["test"], tokenizer, prompt_length=limit, shard_index=0, shard_count=1
        )
    kept = data.prepare_prompts(
        small["test"],
        tokenizer,
        prompt_length=limit,
        overlong="drop",
        shard_index=0,
        shard_count=1,
    )
    assert kept.num_dropped == too_long
    assert kept.num_examples == len(records) - too_long
    assert kept.max_length == max(lengths)
    assert (kept.arrays["prompt_mask"][:, 0] == 1).any()  # Some prompts fill all P columns.
    with pytest.raises(ValueError, match="overlong='truncate'"):
        data.prepare_prompts(
            small["test"],
            tokenizer,
            prompt_length=limit,
            overlong="truncate",
            shard_index=0,
            shard_count=1,
        )


def test_argument_errors(small_prompts):
    with pytest.raises(ValueError, match="both shard_index and shard_count"):
        data.resolve_shard(0, None)
    with pytest.raises(ValueError, match="shard_index=2 not in"):
        data.resolve_shard(2, 2)
    assert data.resolve_shard() == (0, 1)  # Single JAX process.
    with pytest.raises(ValueError, match="batch_size"):
        small_prompts.iterator(0)
    with pytest.raises(ValueError, match="seed"):
        small_prompts.iterator(4, seed=-1)


# ---------------------------------------------------------------- supervised warm start


def test_sft_masks_cover_exactly_the_answer(small, tokenizer, small_prompts):
    from gspo_jax.rewards.arith import arith_exact_reward

    prompt_length, response_length = 64, 10
    sft = data.prepare_sft(
        small["train"],
        tokenizer,
        prompt_length=prompt_length,
        response_length=response_length,
        instruction=None,
        shard_index=0,
        shard_count=1,
    )
    batch = next(sft.iterator(16, seed=0))
    assert batch["tokens"].shape == (16, prompt_length + response_length)
    for key in ("tokens", "loss_mask", "attention_mask"):
        assert batch[key].dtype == np.int32
    prompt_rows = {e: n for n, e in enumerate(small_prompts.arrays["example_id"])}
    for n in range(16):
        tokens, loss, attention = (
            batch["tokens"][n],
            batch["loss_mask"][n],
            batch["attention_mask"][n],
        )
        target = f"#### {batch['reference'][n]}"
        target_ids = tokenizer(target, add_special_tokens=False)["input_ids"] + [2]
        # Loss exactly on the answer and end token, right after the prompt columns.
        expected_loss = np.zeros(prompt_length + response_length, np.int32)
        expected_loss[prompt_length : prompt_length + len(target_ids)] = 1
        np.testing.assert_array_equal(loss, expected_loss)
        assert tokens[loss == 1].tolist() == target_ids
        assert tokenizer.decode(tokens[loss == 1]) == target + "<|im_end|>"
        # The prompt part is exactly what the RL prompt pipeline feeds the sampler.
        row = prompt_rows[batch["example_id"][n]]
        np.testing.assert_array_equal(
            tokens[:prompt_length], small_prompts.arrays["prompt_tokens"][row]
        )
        np.testing.assert_array_equal(
            attention,
            np.concatenate(
                [small_prompts.arrays["prompt_mask"][row], expected_loss[prompt_length:]]
            ),
        )
        assert (tokens[attention == 0] == tokenizer.pad_token_id).all()
        # The supervised answer is exactly what the RL reward accepts.
        completion = tokenizer.decode(tokens[loss == 1], skip_special_tokens=True)
        assert arith_exact_reward("", completion, batch["reference"][n]) == 1.0
    with pytest.raises(ValueError, match="response_length=3"):
        data.prepare_sft(
            small["train"],
            tokenizer,
            prompt_length=64,
            response_length=3,
            shard_index=0,
            shard_count=1,
        )


def test_drop_carry_sum_hand_values():
    # 47 + 85: units 7+5=12 -> 2, tens 4+8=12 -> 2; the carries are lost.
    assert data.drop_carry_sum(47, 85) == 22
    assert data.drop_carry_sum(12, 34) == 46 and not data.needs_carry(12, 34)
    assert data.drop_carry_sum(99, 1) == 90 and data.needs_carry(99, 1)
    assert data.drop_carry_sum(5, 5) == 0 and data.drop_carry_sum(0, 0) == 0


def test_noisy_teacher_corrupts_only_carrying_additions_at_its_rate():
    src = [
        {"id": f"{a}-{b}", "question": f"What is {a} + {b}?", "answer": str(a + b)}
        for a in range(100)
        for b in range(100)
    ]
    src.append({"id": "x", "question": "What is 9 - 3?", "answer": "6"})
    teacher = data.NoisyTeacher(src, 0.6, seed=3)
    assert len(teacher) == len(src)
    got = teacher.__getitems__(list(range(len(src))))
    assert [teacher[i] for i in (0, 4711, len(src) - 1)] == [got[0], got[4711], got[-1]]
    changed = carrying = 0
    for rec, orig in zip(got[:-1], src[:-1]):
        a, b = map(int, orig["id"].split("-"))
        if rec["answer"] != orig["answer"]:
            assert rec["answer"] == str(data.drop_carry_sum(a, b))  # the teacher's mistake
            changed += 1
        carrying += data.needs_carry(a, b)
    assert got[-1]["answer"] == "6"  # not an addition: passed through
    assert abs(changed / carrying - 0.6) < 0.03
    assert data.NoisyTeacher(src, 0.6, seed=3)[123] == teacher[123]  # deterministic
    with pytest.raises(ValueError, match="error_rate"):
        data.NoisyTeacher(src, 1.5)


# ------------------------------------------------------------------ scratchpad task

TINY_PAD = data.ScratchpadConfig(
    name="tiny_pad", min_digits=3, max_digits=9, num_train=60, num_test=20, seed=5
)


def test_worked_solution_adds_column_by_column_and_its_sum_is_exact():
    """Each line is x+y[+1]=total of one column from the units; the answer after ####
    is a + b (with every carry dropped: the carry-free sum the default task's teacher gives)."""
    assert data.worked_solution(4781, 2959) == (
        "4781+2959: 1+9=10\n478+295: 8+5+1=14\n47+29: 7+9+1=17\n4+2: 4+2+1=7\n#### 7740"
    )
    assert data.worked_solution(95, 7) == "95+07: 5+7=12\n9+0: 9+0+1=10\n#### 102"
    assert data.worked_solution(0, 0) == "0+0: 0+0=0\n#### 0"
    rng = np.random.default_rng(0)
    for _ in range(500):
        a, b = (int(x) for x in rng.integers(0, 10 ** int(rng.integers(1, 19)), 2))
        lines = data.worked_solution(a, b).split("\n")
        assert lines[-1] == f"#### {a + b}"
        assert len(lines) == max(len(str(a)), len(str(b))) + 1
        n = len(lines) - 1
        for k, line in enumerate(lines[:-1]):
            left, column = line.split(": ")
            assert left == f"{str(a).zfill(n)[: n - k]}+{str(b).zfill(n)[: n - k]}"
            terms, total = column.split("=")
            assert sum(int(t) for t in terms.split("+")) == int(total)
        assert len(data.worked_solution(a, b)) <= n * n + 14 * n + 4
        careless = data.worked_solution(a, b, drop_carries=True)
        assert careless.endswith(f"#### {data.drop_carry_sum(a, b)}")
        assert all(line.split(": ")[1].count("+") == 1 for line in careless.split("\n")[:-1])


def test_scratchpad_builder_splits_and_records(data_dir):
    """Distinct questions, disjoint splits, both operands of d digits in [3, 9], the
    reference (`final_answer`) the sum and the supervised target its worked solution."""
    got = data.build_dataset("scratchpad", TINY_PAD, data_dir=data_dir)
    train, test = _records(got["train"]), _records(got["test"])
    assert (len(train), len(test)) == (60, 20)
    assert not {r["question"] for r in train} & {r["question"] for r in test}
    for r in train + test:
        a, op, b = QUESTION_RE.match(r["question"]).groups()
        assert op == "+" and len(a) == len(b) and 3 <= len(a) <= 9
        assert r["final_answer"] == str(int(a) + int(b))
        assert r["answer"] == data.worked_solution(int(a), int(b))
    spec = data.get_spec("scratchpad")
    assert (spec.reference_key, spec.answer_key, spec.target_template) == (
        "final_answer",
        "answer",
        "{answer}",
    )


def test_the_teacher_drops_the_carries_of_a_worked_solution(data_dir):
    """At error rate 1 every carrying problem's solution is the careless one, whose stated
    answer the exact verifier scores 0; the reference is untouched."""
    from gspo_jax.rewards.arith import arith_exact_reward

    source = data.build_dataset("scratchpad", TINY_PAD, data_dir=data_dir)["train"]
    teacher = data.NoisyTeacher(source, 1.0, seed=0)
    for i in range(len(source)):
        r, t = data.decode_record(source[i]), teacher[i]
        a, _, b = QUESTION_RE.match(r["question"]).groups()
        careless = data.worked_solution(int(a), int(b), drop_carries=True)
        assert t["answer"] == (careless if data.needs_carry(int(a), int(b)) else r["answer"])
        assert t["final_answer"] == r["final_answer"]
        want = 1.0 if t["answer"] == r["answer"] else 0.0
        assert arith_exact_reward("", t["answer"], t["final_answer"]) == want
