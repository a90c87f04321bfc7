"""LoRA adapters (gspo_jax/models/lora.py): the formula, step 0 = the base model, the
tree split that training uses, the merged and PEFT exports, and config validation."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from configs import default
from gspo_jax import models
from gspo_jax.config import validate as config_lib
from gspo_jax.models import lora

BASE = models.ModelConfig(
    arch="qwen3",
    vocab_size=48,
    hidden_size=16,
    intermediate_size=24,
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
    head_dim=8,
    qk_norm=True,
)
LORA = dataclasses.replace(BASE, lora_rank=4, lora_alpha=8.0)


@pytest.fixture(scope="module")
def trees():
    """(base params, LoRA params on that base with fresh adapters, the same with random B)."""
    base = models.init_params(BASE, jax.random.PRNGKey(0))
    fresh = lora.combine(base, lora.init_adapters(LORA, jax.random.PRNGKey(1)))

    def randomise(a, b):
        return a, 0.3 * jax.random.normal(jax.random.PRNGKey(b.size), b.shape, b.dtype)

    trained = lora.combine(base, lora._map_adapters(lora.trainable(fresh), randomise))
    return base, fresh, trained


@pytest.fixture(scope="module")
def batch():
    tokens = jax.random.randint(jax.random.PRNGKey(5), (2, 7), 0, BASE.vocab_size)
    mask = jnp.ones((2, 7), jnp.int32).at[0, :2].set(0)  # left padding in row 0
    return tokens, mask


def test_fresh_adapters_leave_the_base_model_exactly(trees, batch):
    """B = 0: the merged weights are the base's bit for bit. The logits agree to float
    rounding only: XLA:CPU merges the dots sharing an input (q/k/v and the adapters' A)
    differently, which reorders q's sums (3e-8 here)."""
    base, fresh, _ = trees
    _, merged = lora.merged(LORA, fresh)
    jax.tree.map(np.testing.assert_array_equal, merged, base)
    np.testing.assert_allclose(
        models.forward(LORA, fresh, *batch), models.forward(BASE, base, *batch), rtol=0, atol=1e-6
    )


def test_adapter_init_and_layout(trees):
    _, fresh, _ = trees
    q = fresh["layers"]["attn"]["q_proj"]
    assert q["lora_a"].shape == (2, 16, 4) and q["lora_b"].shape == (2, 4, 2, 8)
    assert not np.any(np.asarray(q["lora_b"]))
    a = np.asarray(fresh["layers"]["mlp"]["down_proj"]["lora_a"])  # fan_in = F = 24
    assert 0 < np.abs(a).max() <= 1 / np.sqrt(24) and a.std() > 0.5 / np.sqrt(3 * 24)
    axes = models.logical_axes(LORA)["layers"]["attn"]
    assert axes["q_proj"]["lora_a"] == ("layers", "embed", None)
    assert axes["q_proj"]["lora_b"] == ("layers", None, "heads", None)
    assert axes["o_proj"]["lora_a"] == ("layers", "heads", None, None)
    assert axes["o_proj"]["lora_b"] == ("layers", None, "embed")
    # Same seed, same adapters; the base's norms and embeddings get none.
    again = lora.init_adapters(LORA, jax.random.PRNGKey(1))
    jax.tree.map(np.testing.assert_array_equal, lora.trainable(fresh), again)
    assert "embed" not in again and "input_norm" not in again["layers"]


def test_partition_combine_and_adapters_off(trees, batch):
    base, _, trained = trees
    frozen, adapters = lora.partition(trained)
    assert jax.tree.structure(frozen) == jax.tree.structure(base)
    assert all(
        k in ("lora_a", "lora_b")
        for p, _ in jax.tree_util.tree_leaves_with_path(adapters)
        for k in [p[-1].key]
    )
    assert jax.tree.structure(lora.combine(frozen, adapters)) == jax.tree.structure(trained)
    assert lora.partition(base) == ({}, base)  # a plain model: everything trains
    off = lora.adapters_off(trained)
    assert (
        off["layers"]["attn"]["q_proj"]["kernel"] is trained["layers"]["attn"]["q_proj"]["kernel"]
    )
    np.testing.assert_allclose(
        models.forward(LORA, off, *batch), models.forward(BASE, base, *batch), rtol=0, atol=1e-6
    )


def test_adapted_projection_is_w_plus_scaled_ba(trees, batch):
    """forward(LoRA) = forward(base with W + (alpha/r)·A·B), and that merged kernel is the
    NumPy formula; scanned and unrolled layers agree."""
    _, _, trained = trees
    cfg, merged = lora.merged(LORA, trained)
    assert cfg == dataclasses.replace(LORA, lora_rank=0) and not lora.has_adapters(merged)
    node = trained["layers"]["attn"]["o_proj"]
    w, a, b = (np.asarray(node[k], np.float64) for k in ("kernel", "lora_a", "lora_b"))
    want = w + 2.0 * np.einsum("nhcr,nrd->nhcd", a, b)  # alpha / r = 8 / 4
    np.testing.assert_allclose(merged["layers"]["attn"]["o_proj"]["kernel"], want, atol=1e-6)
    logits = models.forward(LORA, trained, *batch)
    np.testing.assert_allclose(logits, models.forward(BASE, merged, *batch), atol=2e-5)
    assert not np.allclose(logits, models.forward(BASE, lora.partition(trained)[0], *batch))
    unrolled = dataclasses.replace(LORA, scan_layers=False)
    np.testing.assert_allclose(models.forward(unrolled, trained, *batch), logits, atol=1e-6)


def test_peft_export_names_shapes_and_merge_by_hand(trees, tmp_path):
    base, _, trained = trees
    path = lora.save_peft(LORA, trained, str(tmp_path / "adapter"), base_model="base")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8.0 and config["peft_type"] == "LORA"
    assert sorted(config["target_modules"]) == sorted(LORA.lora_targets)
    peft = load_file(f"{path}/adapter_model.safetensors")
    assert len(peft) == 2 * 7 * 2  # A and B of 7 projections in 2 layers
    pre = "base_model.model.model.layers.1."
    assert peft[pre + "self_attn.q_proj.lora_A.weight"].shape == (4, 16)  # [r, in]
    assert peft[pre + "self_attn.q_proj.lora_B.weight"].shape == (16, 4)  # [out = H·C, r]
    assert peft[pre + "self_attn.o_proj.lora_A.weight"].shape == (4, 16)
    assert peft[pre + "mlp.down_proj.lora_A.weight"].shape == (4, 24)
    assert peft[pre + "mlp.down_proj.lora_B.weight"].shape == (16, 4)
    models.save_pretrained(BASE, base, tmp_path / "base")
    models.save_pretrained(*lora.merged(LORA, trained), tmp_path / "merged")
    w_base = load_file(str(tmp_path / "base" / "model.safetensors"))
    w_merged = load_file(str(tmp_path / "merged" / "model.safetensors"))
    adapted = 0
    for name, w in w_base.items():
        stem = "base_model.model." + name.removesuffix(".weight")
        if stem + ".lora_A.weight" in peft:  # PEFT's merge: W + scale · B @ A
            b, a = peft[stem + ".lora_B.weight"], peft[stem + ".lora_A.weight"]
            w = w + 2.0 * b @ a
            adapted += 1
        np.testing.assert_allclose(w_merged[name], w, atol=1e-6, err_msg=name)
    assert adapted == 14


def _validate(**model):
    c = default.get_config()
    for key, value in model.items():
        c.model[key] = value
    config_lib.validate(c, num_devices=1)


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"lora_rank": -1}, "config.model.lora_rank"),
        ({"lora_rank": 8, "lora_alpha": 0.0}, "config.model.lora_alpha"),
        ({"lora_rank": 8, "lora_targets": "q_proj,qkv"}, "config.model.lora_targets"),
        ({"lora_rank": 8, "lora_targets": ""}, "config.model.lora_targets"),
        (
            {"lora_rank": 8, "arch": "qwen3_moe", "num_experts": 4},
            "config.model.lora_targets",
        ),
    ],
)
def test_bad_lora_settings_name_the_field(fields, named):
    with pytest.raises(config_lib.ConfigError, match=named):
        _validate(**fields)


def test_lora_on_moe_attention_only_is_accepted():
    _validate(lora_rank=4, arch="qwen3_moe", num_experts=4, lora_targets="q_proj,v_proj")
    with pytest.raises(ValueError, match="MoE experts is not supported"):
        dataclasses.replace(
            BASE, arch="qwen3_moe", num_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=8, lora_rank=2,
        )  # fmt: skip
