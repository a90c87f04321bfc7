"""Hugging Face checkpoint directories in and out, without torch.

Where it sits: `trainer/loop.py` starts from `load_pretrained(path)` and hands the trained policy
back with `save_pretrained(model_config, params, path)` (tokenizers: `gspo_jax.data.load_tokenizer`).
The model code never sees file names.

On disk (transformers' layout): `config.json`; `model.safetensors` or shards
`model-0000i-of-0000n.safetensors` plus `model.safetensors.index.json`; weights in torch
(out, in) layout; MoE experts stored per expert (`mlp.experts.{e}.{gate,up,down}_proj.weight`)
with the router at `mlp.gate.weight`; tied models have no `lm_head.weight`.

In memory the parameters are (in, out) kernels with heads split out ([D, H, C] for q_proj,
[H, C, D] for o_proj), experts stacked ([E, D, F]) and every per-layer tensor stacked on a
leading layer axis (HF layer i is index i of the attention stacks, and its rank among the
dense / MoE layers in the `mlp` / `moe` stacks: see models/__init__.py); `_tensor_specs`
is the one table mapping both ways. Loading reads tensor by tensor (each file opened
once; one layer's experts gathered on the host, then written as one slice) and writes each
layer into its stack where the stack lives (`shardings`: on its devices, sharded; never
the whole model on one device, and the host holds one tensor or one layer's experts at a
time). It fails — naming the file, tensor or field — on anything missing, misshapen,
unexpected or unreadable; nothing is ever randomly initialised.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy before safetensors reads bf16)
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from gspo_jax import jsonio
from gspo_jax.models.config import ModelConfig
from gspo_jax.models.params import abstract_params

log = logging.getLogger(__name__)
INDEX_FILE = "model.safetensors.index.json"
# A vision-language Qwen3.5 checkpoint (Qwen3_5ForConditionalGeneration): the language
# model's tensors under this prefix; the vision tower and the multi-token-prediction head
# under the skipped ones.
_TEXT_PREFIX = "model.language_model."
_SKIPPED_PREFIXES = ("model.visual.", "mtp.")
SINGLE_FILE = "model.safetensors"
# Present in some older exports; derived from the config, never a weight.
_IGNORABLE_SUFFIXES = ("rotary_emb.inv_freq",)
_FLOAT_DTYPES = ("F32", "BF16", "F16", "F64")


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One parameter leaf (or one layer of a stacked leaf) and the HF tensor(s) holding it.

    `index`: the layer's index in the leaf's leading layer axis, None for unstacked
    leaves; `shape` is the shape of that layer's slice (of the whole leaf when None).
    kind "copy": same values (HF shape = flattened slice for [H, C] biases, else the same).
    kind "linear": HF [out, in] = slice.reshape(in, out).T, where the slice's first `n_in`
        dims are the input dims.
    kind "experts": slice [E, in, out]; HF tensor e = slice[e].T (one name per expert).
    """

    path: tuple
    index: int | None
    hf_names: tuple[str, ...]
    hf_shape: tuple[int, ...]
    shape: tuple[int, ...]
    kind: str


def _tensor_specs(cfg: ModelConfig) -> list[TensorSpec]:
    """All parameters of `cfg` with their HF names and shapes, in HF order."""
    abstract = abstract_params(cfg)
    specs: list[TensorSpec] = []

    def leaf(path, index):
        node = abstract
        for key in path:
            node = node[key]
        return tuple(node.shape) if index is None else tuple(node.shape[1:])

    def add(path, name, kind, index=None, n_in=1, hf_shape=None):
        shape = leaf(path, index)
        if hf_shape is not None:  # a "copy" stored in another shape (the conv kernel)
            pass
        elif kind == "copy":
            hf_shape = (math.prod(shape),) if path[-1] == "bias" else shape
        elif kind == "linear":
            hf_shape = (math.prod(shape[n_in:]), math.prod(shape[:n_in]))
        else:
            raise AssertionError(kind)
        specs.append(TensorSpec(path, index, (name,), hf_shape, shape, kind))

    add(("embed", "embedding"), "model.embed_tokens.weight", "copy")
    # rank of layer i among the dense / MoE / full-attention / linear layers: its stack index
    dense = moe = full = linear = 0
    for i in range(cfg.num_layers):
        pre = f"model.layers.{i}."
        add(("layers", "input_norm", "scale"), pre + "input_layernorm.weight", "copy", i)
        if cfg.is_linear_layer(i):
            _linear_attn_specs(add, leaf, pre + "linear_attn.", linear)
            linear += 1
        else:
            _attn_specs(cfg, add, pre + "self_attn.", full)
            full += 1
        add(
            ("layers", "post_attn_norm", "scale"),
            pre + "post_attention_layernorm.weight",
            "copy",
            i,
        )
        if cfg.is_moe_layer(i):
            path = ("layers", "moe")
            add(path + ("router", "kernel"), pre + "mlp.gate.weight", "linear", moe)
            for n in ("gate_proj", "up_proj", "down_proj"):
                shape = leaf(path + (n,), moe)
                names = tuple(pre + f"mlp.experts.{e}.{n}.weight" for e in range(cfg.num_experts))
                hf_shape = (shape[2], shape[1])
                specs.append(TensorSpec(path + (n,), moe, names, hf_shape, shape, "experts"))
            if cfg.shared_expert_intermediate_size:
                for n in ("gate_proj", "up_proj", "down_proj"):
                    name = pre + f"mlp.shared_expert.{n}.weight"
                    add(path + ("shared_expert", n, "kernel"), name, "linear", moe)
                name = pre + "mlp.shared_expert_gate.weight"
                add(path + ("shared_expert_gate", "kernel"), name, "linear", moe)
            moe += 1
        else:
            for n in ("gate_proj", "up_proj", "down_proj"):
                add(("layers", "mlp", n, "kernel"), pre + f"mlp.{n}.weight", "linear", dense)
            dense += 1
    add(("final_norm", "scale"), "model.norm.weight", "copy")
    if not cfg.tie_word_embeddings:
        add(("lm_head", "kernel"), "lm_head.weight", "linear")
    return specs


def _attn_specs(cfg: ModelConfig, add, pre: str, i: int) -> None:
    """A full-attention layer's tensors (`pre` = "model.layers.{l}.self_attn."), stack index i."""
    attn = ("layers", "attn")
    for n in "qkv":
        add(attn + (f"{n}_proj", "kernel"), pre + f"{n}_proj.weight", "linear", i)
        if cfg.qkv_bias:
            add(attn + (f"{n}_proj", "bias"), pre + f"{n}_proj.bias", "copy", i)
    add(attn + ("o_proj", "kernel"), pre + "o_proj.weight", "linear", i, n_in=2)
    if cfg.o_bias:
        add(attn + ("o_proj", "bias"), pre + "o_proj.bias", "copy", i)
    if cfg.qk_norm:
        add(attn + ("q_norm", "scale"), pre + "q_norm.weight", "copy", i)
        add(attn + ("k_norm", "scale"), pre + "k_norm.weight", "copy", i)


def _linear_attn_specs(add, leaf, pre: str, i: int) -> None:
    """A Gated DeltaNet layer's tensors (`pre` = "model.layers.{l}.linear_attn."), stack
    index i: projections as linear maps, conv1d [Q, 1, K] (ours [Q, K]), the rest copied."""
    lin = ("layers", "linear_attn")
    for n in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"):
        add(lin + (n, "kernel"), pre + f"{n}.weight", "linear", i)
    add(lin + ("out_proj", "kernel"), pre + "out_proj.weight", "linear", i, n_in=2)
    Q, K = leaf(lin + ("conv1d",), i)
    add(lin + ("conv1d",), pre + "conv1d.weight", "copy", i, hf_shape=(Q, 1, K))
    for n in ("dt_bias", "A_log"):
        add(lin + (n,), pre + n, "copy", i)
    add(lin + ("norm", "scale"), pre + "norm.weight", "copy", i)


def _to_ours(spec: TensorSpec, hf_array: np.ndarray) -> np.ndarray:
    if spec.kind == "copy":
        return hf_array.reshape(spec.shape)
    if spec.kind == "linear":
        return hf_array.T.reshape(spec.shape)
    return hf_array.T  # one expert


def _to_hf(spec: TensorSpec, leaf: np.ndarray) -> Iterator[tuple[str, np.ndarray]]:
    if spec.kind == "copy":
        yield spec.hf_names[0], leaf.reshape(spec.hf_shape)
    elif spec.kind == "linear":
        out_dim, in_dim = spec.hf_shape
        yield spec.hf_names[0], np.ascontiguousarray(leaf.reshape(in_dim, out_dim).T)
    else:
        for e, name in enumerate(spec.hf_names):
            yield name, np.ascontiguousarray(leaf[e].T)


# ------------------------------------------------------------------------------- load


def read_hf_config(path: str | os.PathLike) -> dict[str, Any]:
    """config.json of a checkpoint directory, with errors that name the file."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint directory {str(path)!r} does not exist")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(
            f"{str(config_file)!r} not found: not a Hugging Face checkpoint directory"
        )
    return jsonio.read_json(config_file, what="config.json")


def read_model_config(path: str | os.PathLike, **overrides) -> ModelConfig:
    """`ModelConfig.from_hf_config` of a checkpoint directory's config.json: every field
    type- and range-checked, the error naming the file and the key."""
    hf = read_hf_config(path)
    try:
        return ModelConfig.from_hf_config(hf, **overrides)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{str(Path(path) / 'config.json')!r}: {e}") from None


def _weight_map(path: Path) -> dict[str, str]:
    """Tensor name -> safetensors file name (from the index, or the single file's keys)."""
    index_file = path / INDEX_FILE
    if index_file.is_file():
        try:
            weight_map = jsonio.read_json(index_file, what=INDEX_FILE)["weight_map"]
        except (jsonio.JsonFileError, KeyError, TypeError) as e:
            raise ValueError(f"cannot read weight_map from {str(index_file)!r}: {e!r}") from e
        for file in sorted(set(weight_map.values())):
            if not (path / file).is_file():
                raise FileNotFoundError(
                    f"{str(path / file)!r} (listed in {INDEX_FILE}) does not exist"
                )
        return dict(weight_map)
    single = path / SINGLE_FILE
    if not single.is_file():
        raise FileNotFoundError(
            f"no {SINGLE_FILE} or {INDEX_FILE} in {str(path)!r} (only safetensors are read)"
        )
    with _open(single) as f:
        return {name: SINGLE_FILE for name in f.keys()}  # noqa: SIM118 (safe_open is not a dict)


def _open(file: Path):
    try:
        return safe_open(str(file), framework="numpy")
    except Exception as e:  # SafetensorError, OSError: corrupt header, truncated file, ...
        raise ValueError(f"cannot read safetensors file {str(file)!r}: {e}") from e


def load_pretrained(
    path: str | os.PathLike,
    *,
    dtype: str = "float32",
    compute_dtype: str | None = None,
    shardings: Any = None,
    **config_overrides,
) -> tuple[ModelConfig, dict]:
    """Reads a local HF Qwen2 / Qwen3 / Qwen3-MoE checkpoint directory (no torch).

    Returns (model_config, params) with params in `dtype` (the parameter dtype) and
    model_config.dtype = `compute_dtype` (default: `dtype`). `shardings`: optional
    pytree like the params of `jax.sharding.Sharding`s, to place each tensor directly
    where it belongs (never the whole model on one device first). `config_overrides`
    set other non-checkpoint ModelConfig fields (remat, moe_impl, ...).
    Raises (naming the file / tensor / field) on an unsupported architecture, a missing
    config.json, an unreadable file, a missing, unexpected or misshapen tensor.
    """
    path = Path(path)
    cfg = read_model_config(
        path, param_dtype=dtype, dtype=compute_dtype or dtype, **config_overrides
    )
    weight_map, source = _text_weights(path, _weight_map(path))
    wanted = {
        name: (spec, e) for spec in _tensor_specs(cfg) for e, name in enumerate(spec.hf_names)
    }
    _check_tensor_names(path, cfg, weight_map, wanted)
    np_dtype = np.dtype(jax.numpy.dtype(dtype))
    placer = _Placer(cfg, shardings, np_dtype)
    expert_buffers: dict[tuple, list] = {}  # (path, layer) -> [experts [E, ., .], filled]
    by_file: dict[str, list[str]] = {}
    for name in wanted:
        by_file.setdefault(weight_map[name], []).append(name)
    for file_name, names in sorted(by_file.items()):
        file = path / file_name
        with _open(file) as f:
            available = set(f.keys())
            for name in names:
                spec, e = wanted[name]
                hf_array = _read_tensor(f, file, source.get(name, name), spec, cfg, available)
                if spec.kind != "experts":
                    placer.place(spec, _to_ours(spec, hf_array).astype(np_dtype))
                    continue
                key = (spec.path, spec.index)
                buf = expert_buffers.setdefault(key, [np.empty(spec.shape, np_dtype), 0])
                buf[0][e] = _to_ours(spec, hf_array)
                buf[1] += 1
                if buf[1] == len(spec.hf_names):
                    placer.place(spec, expert_buffers.pop(key)[0])
    return cfg, placer.params


def _text_weights(path: Path, weight_map: dict[str, str]) -> tuple[dict[str, str], dict]:
    """A vision-language checkpoint's language model as a causal LM's tensor names:
    (weight map under "model.…" names, {our name: the name in the file}); the vision and
    MTP tensors dropped with one log line. Any other checkpoint is returned unchanged."""
    if not any(name.startswith(_TEXT_PREFIX) for name in weight_map):
        return weight_map, {}
    out, source, skipped = {}, {}, 0
    for name, file in weight_map.items():
        if name.startswith(_SKIPPED_PREFIXES):
            skipped += 1
            continue
        ours = "model." + name[len(_TEXT_PREFIX) :] if name.startswith(_TEXT_PREFIX) else name
        out[ours], source[ours] = file, name
    if skipped:
        log.info(
            "%s: skipping %d vision-tower / multi-token-prediction tensor(s) (%s*); "
            "loading the language model only",
            path,
            skipped,
            "*, ".join(_SKIPPED_PREFIXES),
        )
    return out, source


def _check_tensor_names(path: Path, cfg: ModelConfig, weight_map: dict, wanted: dict) -> None:
    """Every tensor the model needs is in the checkpoint and nothing else is (but what HF
    checkpoints may carry harmlessly: rotary caches, a tied model's duplicate head)."""
    missing = [name for name in wanted if name not in weight_map]
    if missing:
        raise KeyError(
            f"checkpoint {str(path)!r} ({cfg.arch}) is missing {len(missing)} tensor(s), "
            f"e.g. {missing[:5]}"
        )
    unexpected = [
        name
        for name in weight_map
        if name not in wanted
        and not name.endswith(_IGNORABLE_SUFFIXES)
        # Some tied checkpoints still carry the (identical) head; the embedding wins.
        and not (cfg.tie_word_embeddings and name == "lm_head.weight")
    ]
    if unexpected:
        raise KeyError(
            f"checkpoint {str(path)!r} has {len(unexpected)} tensor(s) that a {cfg.arch} model "
            f"with this config.json does not use, e.g. {sorted(unexpected)[:5]}"
        )


def _read_tensor(f, file: Path, name: str, spec, cfg: ModelConfig, available) -> np.ndarray:
    """Tensor `name` of an open safetensors file, its shape and dtype checked first."""
    if name not in available:
        raise KeyError(f"tensor {name!r} is not in {str(file)!r} (index says it is)")
    tensor_slice = f.get_slice(name)
    shape, file_dtype = tuple(tensor_slice.get_shape()), tensor_slice.get_dtype()
    if shape != spec.hf_shape:
        raise ValueError(
            f"tensor {name!r} in {str(file)!r} has shape {list(shape)}, expected "
            f"{list(spec.hf_shape)} for this config.json ({cfg.arch})"
        )
    if file_dtype not in _FLOAT_DTYPES:
        raise ValueError(
            f"tensor {name!r} in {str(file)!r} has dtype {file_dtype}, expected "
            f"a float dtype {_FLOAT_DTYPES}"
        )
    try:
        return f.get_tensor(name)
    except Exception as err:
        raise ValueError(f"cannot read tensor {name!r} from {str(file)!r}: {err}") from err


class _Placer:
    """Puts each converted tensor into the params tree, in its sharding: a stacked
    per-layer parameter is allocated once (sharded) and filled layer by layer in place."""

    def __init__(self, cfg: ModelConfig, shardings, np_dtype):
        self.np_dtype = np_dtype
        self.shardings = {}
        if shardings is not None:
            for kp, s in jax.tree_util.tree_flatten_with_path(shardings)[0]:
                self.shardings[tuple(getattr(k, "key", getattr(k, "idx", None)) for k in kp)] = s
        self.abstract = {
            tuple(getattr(k, "key", None) for k in kp): leaf
            for kp, leaf in jax.tree_util.tree_flatten_with_path(abstract_params(cfg))[0]
        }
        self.params: dict = {}
        self.stacks: dict[tuple, jax.Array] = {}  # path -> stacked leaf being filled

    def place(self, spec: TensorSpec, value: np.ndarray) -> None:
        sharding = self.shardings.get(spec.path)
        if spec.index is None:
            array = jax.device_put(value, sharding) if sharding is not None else jnp.asarray(value)
        else:
            array = self.stacks.get(spec.path)
            if array is None:
                shape = self.abstract[spec.path].shape
                array = jnp.zeros(shape, self.np_dtype, device=sharding)
            array = _write_layer(array, value, spec.index)
            self.stacks[spec.path] = array
        node = self.params
        for key in spec.path[:-1]:
            node = node.setdefault(key, {})
        node[spec.path[-1]] = array


@functools.cache
def _layer_writer(sharding):
    """Jitted `stack[index] = value`, the stack donated (written in place) and kept in
    `sharding`; the value arrives as numpy and is split by the same sharding."""

    def write(stack, value, index):
        return jax.lax.dynamic_update_index_in_dim(stack, value.astype(stack.dtype), index, 0)

    return jax.jit(write, donate_argnums=0, out_shardings=sharding)


def _write_layer(stack: jax.Array, value: np.ndarray, index: int) -> jax.Array:
    sharding = stack.sharding
    if isinstance(sharding, jax.sharding.NamedSharding):  # the layer axis is never sharded
        spec = jax.sharding.PartitionSpec(*tuple(sharding.spec)[1:])
        value = jax.device_put(value, jax.sharding.NamedSharding(sharding.mesh, spec))
    return _layer_writer(sharding)(stack, value, np.int32(index))


def _host_array(x) -> np.ndarray:
    """Full value of a (possibly multi-host sharded) array on this host."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        x = multihost_utils.process_allgather(x, tiled=True)
    return np.asarray(x)


def _umask() -> int:
    """The process's umask, read without setting it where Linux reports it (os.umask sets
    it, for every thread, while it is read)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)  # elsewhere: set and restore at once
    os.umask(mask)
    return mask


def _check_params_match(cfg: ModelConfig, params, specs) -> None:
    """Every tensor the checkpoint needs is in `params`, with the model's shape."""
    abstract = abstract_params(cfg)
    for spec in specs:
        node, want = params, abstract
        for key in spec.path:
            if not isinstance(node, dict) or key not in node:
                raise KeyError(f"params lack {'/'.join(map(str, spec.path))} needed for {cfg.arch}")
            node, want = node[key], want[key]
        if tuple(node.shape) != tuple(want.shape):
            raise ValueError(
                f"param {'/'.join(map(str, spec.path))} has shape {tuple(node.shape)}, "
                f"expected {tuple(want.shape)}"
            )


def _shard_plan(specs, itemsize: int, max_shard_size: int) -> list[list[TensorSpec]]:
    """The tensors of each shard file, from shapes alone (so tensors are converted one
    shard at a time): a new shard starts where the next tensor would pass the size."""
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        nbytes = math.prod(spec.shape) * itemsize
        if shards[-1] and size + nbytes > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += nbytes
    return shards


def save_pretrained(
    model_config: ModelConfig,
    params,
    path: str | os.PathLike,
    *,
    dtype: str | None = None,
    max_shard_size: int = 5 * 2**30,
    tokenizer=None,
) -> None:
    """Writes an HF checkpoint directory that transformers' AutoModelForCausalLM loads.

    Tensors in `dtype` (default model_config.param_dtype), torch (out, in) layout, experts
    per expert; shards of at most `max_shard_size` bytes with an index when needed;
    config.json as transformers 5.23 writes it; generation_config.json with the special
    token ids when known; the tokenizer's files when one is given. Stale `model*.safetensors`
    files in `path` are removed first. Every process must call this (multi-host arrays are
    gathered); only process 0 writes.
    """
    cfg = model_config
    dtype = dtype or cfg.param_dtype
    np_dtype = np.dtype(jax.numpy.dtype(dtype))
    specs = _tensor_specs(cfg)
    _check_params_match(cfg, params, specs)
    shards = _shard_plan(specs, np_dtype.itemsize, max_shard_size)
    n = len(shards)
    file_names = (
        [SINGLE_FILE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    )

    writer = jax.process_index() == 0
    path = Path(path)
    if writer:
        path.mkdir(parents=True, exist_ok=True)
        for stale in list(path.glob("model*.safetensors")) + [path / INDEX_FILE]:
            if stale.exists():
                stale.unlink()
    weight_map: dict[str, str] = {}
    total_size = 0
    for file_name, shard in zip(file_names, shards):
        tensors: dict[str, np.ndarray] = {}
        for spec in shard:
            node = params
            for key in spec.path:
                node = node[key]
            # One layer at a time: a stacked leaf is sliced where it lives, then fetched.
            leaf = _host_array(node if spec.index is None else node[spec.index]).astype(np_dtype)
            for name, array in _to_hf(spec, leaf):
                tensors[name] = array
                weight_map[name] = file_name
                total_size += array.nbytes
        if writer:
            save_file(tensors, str(path / file_name), metadata={"format": "pt"})
            # safetensors writes a private temporary file (mode 0600) and renames it: give
            # the weights the mode every other file here gets, or teammates cannot read them.
            os.chmod(path / file_name, 0o666 & ~_umask())
        del tensors
    if not writer:
        return
    if n > 1:
        index = {
            "metadata": {"total_size": total_size},
            "weight_map": dict(sorted(weight_map.items())),
        }
        (path / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    (path / "config.json").write_text(json.dumps(cfg.to_hf_config(dtype=dtype), indent=2) + "\n")
    generation = {
        k: v
        for k, v in cfg.to_hf_config().items()
        if k in ("bos_token_id", "eos_token_id", "pad_token_id") and v is not None
    }
    if generation:
        generation["transformers_version"] = "5.23.0"
        (path / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    if tokenizer is not None:
        tokenizer.save_pretrained(str(path))
