"""Orbax checkpoints of converted weights: the folder `jaxserve convert` writes.

Layout of such a folder:
    config.json, tokenizer files, ...   copied from the HF folder
    jaxserve_checkpoint.json            marker: format, dtype, source
    weights/                            Orbax (OCDBT) checkpoint of the model's parameters,
                                        in the model's own layout (transposed linears,
                                        stacked experts), saved from their shards

Restoring reads each parameter straight onto its target sharding (every process reads
only the shards its devices hold), in batches of bounded size, so no host ever holds the
whole model.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from jaxserve.models.weight_map import ParamPath, path_str

MARKER_FILE = "jaxserve_checkpoint.json"
WEIGHTS_DIR = "weights"
FORMAT = "jaxserve-orbax-v1"
# Host memory a restore may stage at once (one parameter may exceed it alone).
RESTORE_BATCH_BYTES = 256 * 2**20


def is_orbax_checkpoint(model_dir: str | Path) -> bool:
    """Whether `model_dir` was written by `save_params` (has the marker file)."""
    return (Path(model_dir) / MARKER_FILE).is_file()


def _nested(flat: dict[ParamPath, object]) -> dict:
    """{("layers", 0, "mlp", "w_gate"): v} -> {"layers": {"0": {"mlp": {"w_gate": v}}}}
    (string keys: Orbax names each array by its key path)."""
    tree: dict = {}
    for path, value in flat.items():
        node = tree
        for key in path[:-1]:
            node = node.setdefault(str(key), {})
        node[str(path[-1])] = value
    return tree


def save_params(model: nnx.Module, out_dir: str | Path, metadata: dict) -> Path:
    """Write the model's parameters (nnx.Param state) as an Orbax checkpoint in
    `out_dir/weights`, and the marker file with `metadata` (e.g. dtype, source).

    Every process of a multi-process run must call this (each writes its shards).

    Raises:
        FileExistsError: `out_dir/weights` already exists.
    """
    import orbax.checkpoint as ocp  # noqa: PLC0415 -- heavy; only for convert and restore

    out_dir = Path(out_dir).resolve()
    target = out_dir / WEIGHTS_DIR
    if target.exists():
        raise FileExistsError(f"{target} already exists; choose an empty --out folder")
    flat = {p: v.get_value() for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(target, _nested(flat))
    checkpointer.wait_until_finished()
    if jax.process_index() == 0:
        (out_dir / MARKER_FILE).write_text(json.dumps({"format": FORMAT, **metadata}, indent=2))
    return target


def restore_params(
    model_dir: str | Path,
    variables: dict[ParamPath, nnx.Variable],
    param_paths: list[ParamPath],
    place: Callable[[str, tuple[str, ...]], jax.sharding.Sharding],
    max_batch_bytes: int | None = None,
    slot_experts: dict[tuple, np.ndarray] | None = None,
) -> None:
    """Fill the abstract `variables` at `param_paths` from `model_dir/weights`, each
    restored directly onto `place(path, logical axes)` and cast to the variable's dtype.

    Parameters are restored in batches of at most `max_batch_bytes` (default
    RESTORE_BATCH_BYTES; one parameter alone if larger): Orbax stages a batch in host
    memory before placing it, so the batch size bounds the host memory a restore needs.

    slot_experts: module path -> [S] logical expert of each physical slot, for MoE
        blocks with redundant (or re-placed) slots: their expert weights are [E, ...]
        in the checkpoint and [S, ...] in the model; each is restored replicated (one
        array's E experts on every device for a moment), slot s gets a copy of expert
        slot_experts[s], then it is placed on its sharding.

    Raises:
        ValueError: the marker names another format, or a parameter is missing from the
            checkpoint or has another shape (names it).
    """
    import orbax.checkpoint as ocp  # noqa: PLC0415

    slot_experts = slot_experts or {}

    model_dir = Path(model_dir).resolve()
    marker = json.loads((model_dir / MARKER_FILE).read_text())
    if marker.get("format") != FORMAT:
        raise ValueError(
            f"{model_dir / MARKER_FILE}: format {marker.get('format')!r}, expected {FORMAT!r}"
        )
    checkpointer = ocp.PyTreeCheckpointer()
    saved = checkpointer.metadata(model_dir / WEIGHTS_DIR).item_metadata.tree
    targets = {}
    gathered = set()  # slot-indexed expert weights restored as [E, ...]
    for path in param_paths:
        var = variables[path]
        node = saved
        for key in path:
            if not isinstance(node, Mapping) or str(key) not in node:
                raise ValueError(f"Orbax checkpoint {model_dir} has no parameter {path_str(path)}")
            node = node[str(key)]
        axes = tuple(var.get_metadata().get("out_sharding") or ())
        shape = tuple(var.shape)
        sharding = place(path_str(path), axes)
        if axes and axes[0] == "experts" and path[:-1] in slot_experts:
            shape = (int(slot_experts[path[:-1]].max()) + 1, *shape[1:])
            sharding = place(path_str(path), ())  # replicated; slots gathered below
            gathered.add(path)
        if tuple(node.shape) != shape:
            raise ValueError(
                f"parameter {path_str(path)}: checkpoint shape {tuple(node.shape)} "
                f"!= model shape {shape}"
            )
        targets[path] = jax.ShapeDtypeStruct(shape, np.dtype(var.dtype), sharding=sharding)
    for batch in _batches(targets, max_batch_bytes or RESTORE_BATCH_BYTES):
        tree = _nested(batch)
        args = ocp.args.PyTreeRestore(
            item=tree,
            restore_args=ocp.checkpoint_utils.construct_restore_args(tree),
            partial_restore=True,
        )
        restored = checkpointer.restore(model_dir / WEIGHTS_DIR, args=args)
        for path in batch:
            node = restored
            for key in path:
                node = node[str(key)]
            if path in gathered:
                axes = tuple(variables[path].get_metadata().get("out_sharding") or ())
                node = jax.device_put(
                    node[np.asarray(slot_experts[path[:-1]])], place(path_str(path), axes)
                )
            variables[path].set_value(node)


def _batches(
    targets: dict[ParamPath, jax.ShapeDtypeStruct], max_bytes: int
) -> list[dict[ParamPath, jax.ShapeDtypeStruct]]:
    """Consecutive groups of parameters of at most max_bytes each (a larger one alone)."""
    batches: list[dict] = [{}]
    size = 0
    for path, target in targets.items():
        nbytes = int(np.prod(target.shape)) * np.dtype(target.dtype).itemsize
        if batches[-1] and size + nbytes > max_bytes:
            batches.append({})
            size = 0
        batches[-1][path] = target
        size += nbytes
    return [b for b in batches if b]
