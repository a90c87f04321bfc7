"""sharding.py: logical axes -> mesh specs, malformed annotations, the mesh shape, and the
one-process behaviour of the multi-process helpers."""

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from gspo_jax import models, sharding

MESH = {"data": 2, "fsdp": 2, "tensor": 2, "expert": 1}


@pytest.fixture(scope="module")
def mesh():
    return sharding.make_mesh(MESH)


def _abstract(*shapes):
    return {f"w{i}": jax.ShapeDtypeStruct(s, np.float32) for i, s in enumerate(shapes)}


def test_logical_names_map_to_mesh_axes(mesh):
    abstract = _abstract((8, 4), (6, 4), (4,), (3, 4))
    logical = {
        "w0": ("vocab", "embed"),
        "w1": ("embed", "mlp"),
        "w2": None,
        "w3": ("embed", None),  # 3 rows do not split over fsdp=2: replicated, not an error
    }
    out = sharding.tree_shardings(abstract, logical, mesh)
    assert out["w0"].spec == P("tensor", "fsdp")
    assert out["w1"].spec == P("fsdp", "tensor")
    assert out["w2"].spec == P()
    assert out["w3"].spec == P(None, None)


@pytest.mark.parametrize(
    "names,match",
    [
        ("embed", "must be a tuple of names"),  # a bare string, not a tuple
        (["embed", None], "must be a tuple of names"),
        (("embd", None), "logical axis 'embd' has no rule"),  # misspelt
        (("embed",), r"do not match shape \(8, 4\)"),  # wrong length
    ],
)
def test_malformed_logical_axes_raise_naming_the_leaf(mesh, names, match):
    with pytest.raises(ValueError, match=match) as err:
        sharding.tree_shardings(_abstract((8, 4)), {"w0": names}, mesh)
    assert "w0" in str(err.value)


def test_every_model_parameter_has_well_formed_axes(mesh):
    cfg = models.ModelConfig(
        arch="qwen3_moe",
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=8,
    )
    abstract = models.abstract_params(cfg)
    out = sharding.tree_shardings(abstract, models.logical_axes(cfg), mesh)
    assert out["embed"]["embedding"].spec == P("tensor", "fsdp")


def test_mesh_shape_resolves_one_free_axis():
    assert sharding.mesh_shape({"data": -1, "fsdp": 2, "tensor": 1, "expert": 1}, 8) == {
        "data": 4,
        "fsdp": 2,
        "tensor": 1,
        "expert": 1,
    }
    with pytest.raises(ValueError, match="only one mesh axis may be -1"):
        sharding.mesh_shape({"data": -1, "fsdp": -1, "tensor": 1, "expert": 1}, 8)
    with pytest.raises(ValueError, match="config.mesh.tensor=0"):
        sharding.mesh_shape({"data": -1, "fsdp": 1, "tensor": 0, "expert": 1}, 8)
    with pytest.raises(ValueError, match="has 4 devices, but 8 are present"):
        sharding.mesh_shape({"data": 2, "fsdp": 2, "tensor": 1, "expert": 1}, 8)


def test_host_helpers_with_one_process():
    assert sharding.host_max(5) == 5
    np.testing.assert_array_equal(sharding.host_sum(np.array([1.0, 2.0])), [1.0, 2.0])
    assert sharding.gather_json({"a": [1, 2]}) == [{"a": [1, 2]}]
    assert sharding.lead_first("x", lambda: "lead", lambda: "other") == "lead"
    tree = {"w": jax.numpy.ones((2, 3))}
    gathered = sharding.gather_params(tree)
    assert isinstance(gathered["w"], np.ndarray) and gathered["w"].shape == (2, 3)
