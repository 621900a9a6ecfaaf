"""Load a HF model folder (config.json + safetensors) into an NNX model, and export back.

The model is built abstractly (`nnx.eval_shape`: no weights allocated), then each
parameter is read tensor by tensor with `safetensors.safe_open` (never a whole file),
cast, and placed directly on its target sharding. Which sharding each parameter gets is
one hook, `ShardingFn`; the rules table that fills it lives in `jaxserve.sharding`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import re
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from jaxserve.logs import ProgressLog
from jaxserve.models.checkpoint import is_orbax_checkpoint, restore_params
from jaxserve.models.config import ModelConfig, normalize_token_ids
from jaxserve.models.decoder import DecoderOnlyLM
from jaxserve.models.fp8 import DEFAULT_BLOCK, RAW_DTYPES, SCALE_SUFFIX, RawReader, dequantize_block
from jaxserve.models.layers import Parallelism
from jaxserve.models.registry import model_class
from jaxserve.models.weight_map import CheckpointLayout, ParamPath, WeightSpec, path_str

logger = logging.getLogger(__name__)

# (parameter path like "layers.0.mlp.w_gate", its logical axes) -> where it is placed.
ShardingFn = Callable[[str, tuple[str, ...]], jax.sharding.Sharding]

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

# Checkpoint tensors that are safe to leave unread (non-persistent buffers of old exports).
_IGNORABLE_SUFFIXES = ("rotary_emb.inv_freq",)


def load_config(model_dir: str | Path) -> ModelConfig:
    """Parse `config.json`, adding the EOS ids of `generation_config.json` if present
    (HF `generate` stops on those, and instruct models list extra ones there)."""
    model_dir = Path(model_dir)
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path} not found (is {model_dir} a HF model folder?)")
    config = ModelConfig.from_hf(_read_json(config_path))
    gen_path = model_dir / "generation_config.json"
    if gen_path.is_file():
        extra = normalize_token_ids(_read_json(gen_path).get("eos_token_id"))
        eos = config.eos_token_ids + tuple(t for t in extra if t not in config.eos_token_ids)
        config = dataclasses.replace(config, eos_token_ids=eos)
    return config


def _read_json(path: Path) -> dict:
    """A JSON object file; ValueError naming the file (and the line and column of a
    syntax error) otherwise."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(
            f"{path}: not valid JSON: {e.msg} at line {e.lineno} column {e.colno}"
        ) from None
    if not isinstance(value, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def default_sharding_fn(mesh: jax.sharding.Mesh | None = None) -> ShardingFn:
    """Replicate every parameter over `mesh`, or put it on the first device if None."""
    if mesh is None:
        target = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    else:
        target = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    return lambda path, axes: target


def load_model(
    model_dir: str | Path,
    dtype: jnp.dtype | str = jnp.float32,
    mesh: jax.sharding.Mesh | None = None,
    shardings: ShardingFn | None = None,
    parallel: Parallelism | None = None,
) -> tuple[DecoderOnlyLM, ModelConfig]:
    """Build the model of `model_dir` and fill it from its safetensors (or from the
    Orbax checkpoint of a folder written by `jaxserve convert`).

    Args:
        model_dir: HF folder with config.json and model.safetensors, or sharded
            *.safetensors with model.safetensors.index.json; or a `jaxserve convert`
            output folder (`jaxserve.models.checkpoint`).
        dtype: parameter dtype, a JAX dtype or its name ("bfloat16"); checkpoint tensors
            are cast to it.
        mesh: the device mesh; with no `shardings`, parameters are replicated over it.
        shardings: the placement hook, (path, logical axes) -> Sharding.
        parallel: how the model runs on `mesh` (`jaxserve.sharding.parallel`); None on
            one device. `jaxserve.sharding.load_sharded_model` passes all three.

    Returns:
        (model with concrete, placed parameters, its ModelConfig).

    Raises:
        ValueError: unsupported architecture (lists the supported ones), a missing or
            mis-shaped tensor (names it and the shapes), or checkpoint tensors no
            parameter reads.
        FileNotFoundError: no config.json or no safetensors files.
    """
    model_dir = Path(model_dir)
    dtype = jnp.dtype(dtype)
    config = load_config(model_dir)
    cls = model_class(config.architecture)
    abstract = nnx.eval_shape(lambda: cls(config, dtype, rngs=nnx.Rngs(0), parallel=parallel))
    place = shardings or default_sharding_fn(mesh)
    graphdef, state = nnx.split(abstract)
    variables = dict(nnx.to_flat_state(state))
    buffers = abstract.initial_buffers()
    slot_experts = _slot_experts(buffers, config.num_experts)
    if is_orbax_checkpoint(model_dir):
        params = [p for p in variables if p not in buffers]
        restore_params(model_dir, variables, params, place, slot_experts=slot_experts)
    else:
        specs = abstract.hf_weight_specs()
        _check_specs_cover(specs, {p: v for p, v in variables.items() if p not in buffers})
        _read_safetensors(model_dir, config, specs, variables, place, slot_experts)
    fill_buffers(variables, buffers, place)
    return nnx.merge(graphdef, nnx.from_flat_state(variables)), config


def _slot_experts(buffers: dict[ParamPath, object], num_experts: int) -> dict[tuple, np.ndarray]:
    """MoE module path -> [S] logical expert of each physical slot, for the blocks whose
    S slots are not the checkpoint's E experts (redundant slots, on a mesh); {} when
    every block holds exactly the checkpoint's experts."""
    slot_experts = {}
    for path, value in buffers.items():
        if path[-1] == "physical_to_logical":
            p2l = np.asarray(value)
            if not np.array_equal(p2l, np.arange(num_experts)):
                slot_experts[path[:-1]] = p2l
    return slot_experts


def _read_safetensors(
    model_dir: Path,
    config: ModelConfig,
    specs: list[WeightSpec],
    variables: dict[ParamPath, nnx.Variable],
    place: ShardingFn,
    slot_experts: dict[tuple, np.ndarray] | None = None,
) -> None:
    """Fill each parameter from its checkpoint tensors, one tensor at a time. The expert
    weights of a block in `slot_experts` (module path -> [S] logical expert of each
    slot) are [E, ...] in the checkpoint and [S, ...] in the model: slot s gets a copy
    of expert slot_experts[s]."""
    slot_experts = slot_experts or {}
    progress = ProgressLog(logger, f"loading weights of {model_dir.name}", len(specs), "tensors")
    with _CheckpointReader(model_dir, config.fp8_weight_block) as checkpoint:
        for spec in specs:
            progress.advance()
            var = variables[spec.path]
            layout = _pick_layout(spec, checkpoint)
            value = layout.to_param(
                [checkpoint.read(n, s) for n, s in zip(layout.names, layout.shapes, strict=True)]
            )
            axes = var.get_metadata().get("out_sharding") or ()
            if axes and axes[0] == "experts" and spec.path[:-1] in slot_experts:
                value = np.asarray(value)[slot_experts[spec.path[:-1]]]
            if value.shape != tuple(var.shape):
                raise ValueError(
                    f"parameter {path_str(spec.path)}: converted shape {value.shape} "
                    f"!= model shape {tuple(var.shape)}"
                )
            sharding = place(path_str(spec.path), tuple(axes))
            var.set_value(jax.device_put(value.astype(np.dtype(var.dtype)), sharding))
        _report_unused(checkpoint, config)


def fill_buffers(
    variables: dict[ParamPath, nnx.Variable], buffers: dict[ParamPath, object], place: ShardingFn
) -> None:
    """Set the non-weight state (`DecoderOnlyLM.initial_buffers`) on its placement."""
    for path, value in buffers.items():
        var = variables[path]
        var.set_value(
            jax.device_put(np.asarray(value, np.dtype(var.dtype)), place(path_str(path), ()))
        )


def save_hf_weights(model: DecoderOnlyLM, path: str | Path) -> Path:
    """Write the model's weights as HF-named safetensors (the inverse of the name map).

    Experts are written per expert (`...experts.{e}.gate_proj.weight`), the layout that
    transformers `from_pretrained` reads for both families; a model on a mesh with
    redundant (or EPLB re-placed) expert slots writes each logical expert once, from the
    first slot holding it. `path` is a folder; the file
    is `path/model.safetensors` (the whole model passes through host memory: meant for
    small models such as the demo model). config.json is the caller's to write.
    """
    out_dir = Path(path)
    out_dir.mkdir(parents=True, exist_ok=True)
    variables = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    state = dict(nnx.to_flat_state(nnx.state(model)))
    tensors: dict[str, np.ndarray] = {}
    for spec in model.hf_weight_specs():
        layout = next(lay for lay in spec.layouts if lay.from_param is not None)
        var = variables[spec.path]
        value = np.asarray(jax.device_get(var.get_value()))
        # Slot-indexed experts (a mesh with redundant slots, or re-placed by EPLB): each
        # logical expert from its first slot (replicas hold the same weights).
        l2p = state.get((*spec.path[:-1], "logical_to_physical"))
        axes = var.get_metadata().get("out_sharding") or ()
        if l2p is not None and axes and axes[0] == "experts":
            value = value[np.asarray(jax.device_get(l2p.get_value()))[:, 0]]
        for name, tensor in zip(layout.names, layout.from_param(value), strict=True):
            tensors[name] = np.ascontiguousarray(tensor)
    target = out_dir / SINGLE_FILE
    save_file(tensors, str(target), metadata={"format": "pt"})
    return target


class _CheckpointReader(contextlib.AbstractContextManager):
    """Tensor-by-tensor reads across the safetensors files of a folder. An FP8 tensor
    with a `<name>_scale_inv` beside it is dequantized to float32 as it is read
    (`models.fp8`; scale blocks of `fp8_block`, default 128x128)."""

    def __init__(self, model_dir: Path, fp8_block: tuple[int, int] | None = None):
        self._files: dict[str, Path] = _tensor_files(model_dir)
        self._fp8_block = fp8_block or DEFAULT_BLOCK
        self._raw = RawReader()
        self._handles: dict[Path, object] = {}
        self._stack = contextlib.ExitStack()
        self.read_names: set[str] = set()

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def names(self) -> set[str]:
        return set(self._files)

    def has(self, name: str) -> bool:
        return name in self._files

    def read(self, name: str, expected_shape: tuple[int, ...]) -> np.ndarray:
        """One tensor as a NumPy array; ValueError if its shape is not `expected_shape`."""
        file = self._files[name]
        if file not in self._handles:
            self._handles[file] = self._stack.enter_context(_open_safetensors(file))
        handle = self._handles[file]
        shape = tuple(handle.get_slice(name).get_shape())
        if shape != tuple(expected_shape):
            raise ValueError(
                f"checkpoint tensor {name!r} has shape {shape}, expected {tuple(expected_shape)}"
            )
        self.read_names.add(name)
        if handle.get_slice(name).get_dtype() not in RAW_DTYPES:
            return handle.get_tensor(name)
        tensor = self._raw.read(file, name)
        scale = name + SCALE_SUFFIX
        if scale not in self._files:
            return tensor.astype(np.float32)
        blocks = tuple(-(-n // b) for n, b in zip(shape, self._fp8_block, strict=True))
        return dequantize_block(tensor, self.read(scale, blocks), self._fp8_block)


def _tensor_files(model_dir: Path) -> dict[str, Path]:
    """Tensor name -> file, from the index if sharded, else from the files' headers."""
    index = model_dir / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: model_dir / file for name, file in weight_map.items()}
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    names: dict[str, Path] = {}
    for file in files:
        with _open_safetensors(file) as handle:
            names.update(dict.fromkeys(handle.keys(), file))
    return names


def _open_safetensors(file: Path):
    """`safe_open(file)`; ValueError naming the file if it is not a readable safetensors
    file (truncated, not safetensors): safetensors' own message does not name it."""
    try:
        return safe_open(str(file), framework="np")
    except SafetensorError as err:
        raise ValueError(f"{file}: not a readable safetensors file ({err})") from err


def _pick_layout(spec: WeightSpec, checkpoint: _CheckpointReader) -> CheckpointLayout:
    for layout in spec.layouts:
        if all(checkpoint.has(n) for n in layout.names):
            return layout
    # Name the first missing tensor of each candidate layout.
    missing = [next(n for n in lay.names if not checkpoint.has(n)) for lay in spec.layouts]
    raise ValueError(
        f"checkpoint is missing tensor {missing[0]!r} (for parameter {path_str(spec.path)}"
        + (f"; alternative layouts also missing {missing[1:]}" if len(missing) > 1 else "")
        + ")"
    )


def _check_specs_cover(specs: list[WeightSpec], variables: dict[ParamPath, nnx.Variable]):
    # A name-map bug, not a user error: every parameter needs exactly one spec.
    spec_paths = [s.path for s in specs]
    if sorted(map(path_str, spec_paths)) != sorted(map(path_str, variables)):
        raise RuntimeError(
            "weight name map does not match the model's parameters: "
            f"unmapped {sorted(set(map(path_str, variables)) - set(map(path_str, spec_paths)))}, "
            f"unknown {sorted(set(map(path_str, spec_paths)) - set(map(path_str, variables)))}"
        )


_LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.")


def _report_unused(checkpoint: _CheckpointReader, config: ModelConfig) -> None:
    unused = sorted(checkpoint.names() - checkpoint.read_names)
    if config.num_mtp_layers:
        # DeepSeek's multi-token-prediction modules follow the decoder layers
        # (model.layers.{num_hidden_layers}...): speculative-decoding weights, not served.
        mtp = [
            n
            for n in unused
            if (m := _LAYER_NAME.match(n)) and int(m.group(1)) >= config.num_hidden_layers
        ]
        if mtp:
            layers = sorted({int(_LAYER_NAME.match(n).group(1)) for n in mtp})
            logger.info(
                "skipping %d tensors of the multi-token-prediction layer(s) %s (not served)",
                len(mtp),
                layers,
            )
            unused = [n for n in unused if n not in set(mtp)]
    harmless = [
        n
        for n in unused
        if n.endswith(_IGNORABLE_SUFFIXES) or (config.tie_word_embeddings and n == "lm_head.weight")
    ]
    suspicious = [n for n in unused if n not in harmless]
    if suspicious:
        raise ValueError(
            f"checkpoint has {len(suspicious)} tensors no parameter reads (unsupported "
            f"feature or name-map bug): {suspicious[:10]}"
        )
    if harmless:
        logger.warning("ignoring unused checkpoint tensors: %s", harmless)
