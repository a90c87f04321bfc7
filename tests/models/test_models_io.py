"""Checkpoint I/O specification: load/save Hugging Face directories without torch.

- save -> load is exact (f32 and bf16), for single-file and sharded output;
- our save writes exactly the tensor names, shapes and dtypes transformers wrote for the
  same model, and config.json with the same keys, which transformers' AutoConfig reads
  back to the same values;
- every bad input fails with a message naming the architecture / tensor / file;
- the fixture tokenizer loads with AutoTokenizer from its directory, chat template works.
"""

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from gspo_jax import models
from gspo_jax.data import load_tokenizer

FIXTURES = Path(__file__).parents[1] / "fixtures" / "models"
FAMILIES = ("qwen2", "qwen3", "qwen3_moe", "llama")


def _tensors(directory: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    out = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(str(file), "numpy") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                s = f.get_slice(name)
                out[name] = (tuple(s.get_shape()), s.get_dtype())
    return out


@pytest.fixture(scope="module")
def loaded():
    return {name: models.load_pretrained(FIXTURES / name) for name in FAMILIES}


@pytest.mark.parametrize("name", FAMILIES)
def test_save_matches_transformers_layout_and_load_is_exact(loaded, name, tmp_path):
    cfg, params = loaded[name]
    hf_config = json.loads((FIXTURES / name / "config.json").read_text())
    dtype = hf_config["dtype"]  # save in the fixture's dtype (bf16 for the MoE)
    models.save_pretrained(cfg, params, tmp_path, dtype=dtype)
    assert _tensors(tmp_path) == _tensors(FIXTURES / name)
    ours = json.loads((tmp_path / "config.json").read_text())
    assert set(ours) == set(hf_config)
    for key in set(ours) - {"initializer_range", "max_window_layers"}:
        assert ours[key] == hf_config[key], key

    cfg2, params2 = models.load_pretrained(tmp_path)
    assert cfg2 == cfg
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params2)):
        np.testing.assert_array_equal(a, b)
    assert jax.tree.structure(params) == jax.tree.structure(params2)


def test_transformers_autoconfig_reads_our_config(loaded, tmp_path):
    from transformers import AutoConfig

    for name in FAMILIES:
        cfg, params = loaded[name]
        models.save_pretrained(cfg, params, tmp_path / name)
        ours = AutoConfig.from_pretrained(str(tmp_path / name), local_files_only=True)
        theirs = AutoConfig.from_pretrained(str(FIXTURES / name), local_files_only=True)
        keys = set(theirs.to_dict()) - {
            "initializer_range",
            "max_window_layers",
            "dtype",
            "_name_or_path",
        }
        assert len(keys) > 20
        for key in keys:
            assert getattr(ours, key) == getattr(theirs, key), (name, key)


def test_sharded_bf16_save_round_trip(loaded, tmp_path):
    cfg, params = loaded["qwen3_moe"]
    models.save_pretrained(cfg, params, tmp_path, dtype="bfloat16", max_shard_size=30_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert set(index["weight_map"]) == set(_tensors(tmp_path))
    cfg16, p16 = models.load_pretrained(tmp_path, dtype="bfloat16")
    assert cfg16.param_dtype == "bfloat16"
    # The MoE fixture is bf16-valued, so bf16 storage is lossless here.
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(p16)):
        assert b.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b, np.float32))
    # Re-saving into the same directory as a single file leaves no stale shards behind.
    models.save_pretrained(cfg, params, tmp_path)
    assert sorted(p.name for p in tmp_path.glob("model*")) == ["model.safetensors"]
    cfg32, _ = models.load_pretrained(tmp_path)
    assert cfg32.arch == "qwen3_moe"


def test_generation_config_and_tokenizer_are_written(loaded, tmp_path):
    cfg, params = loaded["qwen3"]
    tok = load_tokenizer(FIXTURES / "tokenizer")
    models.save_pretrained(cfg, params, tmp_path, tokenizer=tok)
    gen = json.loads((tmp_path / "generation_config.json").read_text())
    assert gen["eos_token_id"] == 2 and gen["pad_token_id"] == 0
    assert load_tokenizer(tmp_path).get_vocab() == tok.get_vocab()


def test_tokenizer_loads_and_chat_template_works():
    tok = load_tokenizer(FIXTURES / "tokenizer")
    text = tok.apply_chat_template(
        [{"role": "user", "content": "What is 3 + 4?"}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<|im_start|>user\nWhat is 3 + 4?<|im_end|>\n<|im_start|>assistant\n"
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == text
    assert max(ids) < 256  # fits the fixture models' vocab
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>"]) == [0, 2]


# ------------------------------------------------------------------------- bad input


def _copy(name: str, tmp_path: Path) -> Path:
    dst = tmp_path / name
    shutil.copytree(FIXTURES / name, dst)
    return dst


def _rewrite(file: Path, edit) -> None:
    with safe_open(str(file), "numpy") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    edit(tensors)
    save_file(tensors, str(file), metadata={"format": "pt"})


def test_missing_tensor_is_named(tmp_path):
    d = _copy("qwen2", tmp_path)
    name = "model.layers.1.self_attn.k_proj.bias"
    _rewrite(d / "model.safetensors", lambda t: t.pop(name))
    with pytest.raises(KeyError, match=name.replace(".", r"\.")):
        models.load_pretrained(d)


def test_missing_expert_tensor_is_named(tmp_path):
    d = _copy("qwen3_moe", tmp_path)
    name = "model.layers.2.mlp.experts.5.down_proj.weight"
    _rewrite(d / "model.safetensors", lambda t: t.pop(name))
    with pytest.raises(KeyError, match=name.replace(".", r"\.")):
        models.load_pretrained(d)


def test_wrong_shape_is_named(tmp_path):
    d = _copy("qwen2", tmp_path)
    name = "model.layers.0.mlp.up_proj.weight"

    def edit(t):
        t[name] = t[name][:-1]

    _rewrite(d / "model.safetensors", edit)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.up_proj\.weight.*shape"):
        models.load_pretrained(d)


def test_unexpected_tensor_is_named(tmp_path):
    d = _copy("qwen2", tmp_path)

    def edit(t):
        t["model.layers.0.self_attn.o_proj.bias"] = np.zeros(32, np.float32)

    _rewrite(d / "model.safetensors", edit)
    with pytest.raises(KeyError, match=r"o_proj\.bias"):
        models.load_pretrained(d)


def test_corrupt_safetensors_file_is_named(tmp_path):
    d = _copy("qwen3", tmp_path)
    shard = d / "model-00002-of-00004.safetensors"
    shard.write_bytes(b"\x00" * 8 + b"not a safetensors header")
    with pytest.raises(ValueError, match="model-00002-of-00004.safetensors"):
        models.load_pretrained(d)


def test_truncated_safetensors_file_is_named(tmp_path):
    d = _copy("qwen2", tmp_path)
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"model\.safetensors"):
        models.load_pretrained(d)


def test_missing_shard_file_is_named(tmp_path):
    d = _copy("qwen3", tmp_path)
    (d / "model-00003-of-00004.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model-00003-of-00004.safetensors"):
        models.load_pretrained(d)


def test_missing_config_json_is_named(tmp_path):
    d = _copy("qwen3", tmp_path)
    (d / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json"):
        models.load_pretrained(d)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        models.load_pretrained(tmp_path / "nowhere")


def test_unparsable_config_json_is_named(tmp_path):
    d = _copy("qwen3", tmp_path)
    (d / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json"):
        models.load_pretrained(d)


def test_no_weights_is_named(tmp_path):
    d = _copy("qwen2", tmp_path)
    (d / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        models.load_pretrained(d)


@pytest.mark.parametrize(
    "edit, message",
    [
        ({"model_type": "mistral", "architectures": ["MistralForCausalLM"]}, "mistral"),
        (
            {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "mlp_bias": True},
            "mlp_bias",
        ),
        (
            {"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "rope_theta": 1e4}},
            "llama3.*low_freq_factor",
        ),
        ({"architectures": ["Qwen2ForSequenceClassification"]}, "Qwen2ForSequenceClassification"),
        ({"use_sliding_window": True, "sliding_window": 8}, "sliding"),
        ({"hidden_act": "gelu"}, "gelu"),
        ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "dynamic"),
    ],
)
def test_unsupported_config_is_named(tmp_path, edit, message):
    d = _copy("qwen2", tmp_path)
    hf = json.loads((d / "config.json").read_text())
    hf.update(edit)
    (d / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ValueError, match=message):
        models.load_pretrained(d)


def test_save_rejects_params_that_do_not_fit_the_config(loaded, tmp_path):
    cfg, params = loaded["qwen2"]
    bad = jax.tree.map(lambda x: x, params)
    bad["final_norm"]["scale"] = bad["final_norm"]["scale"][:-1]
    with pytest.raises(ValueError, match="final_norm/scale"):
        models.save_pretrained(cfg, bad, tmp_path)
    bad["final_norm"] = params["final_norm"]
    del bad["lm_head"]
    with pytest.raises(KeyError, match="lm_head"):
        models.save_pretrained(cfg, bad, tmp_path)
