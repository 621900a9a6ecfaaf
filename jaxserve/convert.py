"""`jaxserve convert --model HF_DIR --out DIR`: a Hugging Face folder to an Orbax checkpoint.

The weights are converted once (transposed linears, stacked experts, cast to --dtype),
placed on their shards of the --mesh, and saved with Orbax from the shards; config.json,
the tokenizer and the other small files are copied beside them. `jaxserve serve --model
DIR` and `load_model(DIR)` accept the result (`jaxserve.models.checkpoint`), restoring
each parameter straight onto its shards.

Exit status: 0 done; 1 the system refused (memory, a device, a disk); 2 a usage error
or bad setting: a bad flag value, a --model folder that is no HF model or whose weights
are broken, an --out folder that cannot be written or holds a checkpoint already, a
--mesh with more devices than are visible (one line, naming the flag where one is at
fault).

This module must not import JAX at import time (the CLI imports it to register the
subcommand).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

# Files of a HF folder that the converted checkpoint replaces.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".msgpack", ".h5")
_WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


def convert(model_dir: str | Path, out_dir: str | Path, dtype: str = "float32", mesh=None):
    """Convert `model_dir` into `out_dir` (created; must not hold a checkpoint yet).

    Args:
        model_dir: HF folder (config.json + safetensors).
        out_dir: output folder.
        dtype: "float32" or "bfloat16", the stored parameter dtype.
        mesh: a `jaxserve.config.MeshConfig` to shard over while converting (default:
            one device). The checkpoint can be restored onto any mesh.

    Returns:
        {"load_s": seconds to load from safetensors, "save_s": seconds to save}.

    Raises:
        FileExistsError: out_dir already holds a checkpoint; and `load_model`'s errors.
    """
    from jaxserve.models.checkpoint import save_params  # noqa: PLC0415 -- imports JAX
    from jaxserve.models.loader import load_model  # noqa: PLC0415

    model_dir, out_dir = Path(model_dir), Path(out_dir)
    start = time.perf_counter()
    if mesh is None or mesh.size == 1:
        model, config = load_model(model_dir, dtype)
    else:
        from jaxserve.sharding.load import load_sharded_model  # noqa: PLC0415
        from jaxserve.sharding.mesh import build_mesh_from_config  # noqa: PLC0415

        model, config = load_sharded_model(model_dir, build_mesh_from_config(mesh), dtype)
    loaded = time.perf_counter()
    out_dir.mkdir(parents=True, exist_ok=True)
    save_params(
        model,
        out_dir,
        {"dtype": dtype, "architecture": config.architecture, "source": str(model_dir)},
    )
    saved = time.perf_counter()
    _copy_side_files(model_dir, out_dir)
    return {"load_s": loaded - start, "save_s": saved - loaded}


def _copy_side_files(model_dir: Path, out_dir: Path) -> None:
    """config.json, tokenizer and generation files: everything but the weights."""
    for path in model_dir.iterdir():
        if path.is_file() and not (
            path.name.endswith(_WEIGHT_SUFFIXES) or path.name in _WEIGHT_INDEXES
        ):
            shutil.copy2(path, out_dir / path.name)


def add_subparser(sub: argparse._SubParsersAction) -> None:
    """Register `jaxserve convert` on the CLI's subparsers."""
    c = sub.add_parser(
        "convert",
        help="convert a HF model folder to an Orbax checkpoint",
        description="Convert a Hugging Face model folder (config.json, safetensors) into an "
        "Orbax checkpoint that `jaxserve serve --model OUT` restores straight onto its "
        "shards, on any mesh; the tokenizer and config files are copied beside it.",
    )
    c.add_argument("--model", required=True, help="the Hugging Face model folder to read")
    c.add_argument("--out", required=True, help="the folder to write (must hold no checkpoint)")
    c.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="the stored parameter dtype (default float32)",
    )
    c.add_argument(
        "--mesh",
        default="dp=1,tp=1",
        help="devices to shard over while converting, e.g. dp=2,tp=4 (default one device); "
        "the checkpoint restores onto any mesh",
    )
    c.set_defaults(func=_cmd_convert)


def _cmd_convert(args: argparse.Namespace) -> int:
    from jaxserve.config import MeshConfig  # noqa: PLC0415
    from jaxserve.flag_types import check_writable  # noqa: PLC0415
    from jaxserve.frontend.client_auth import flag_error  # noqa: PLC0415
    from jaxserve.logs import start_failure_code  # noqa: PLC0415
    from jaxserve.preflight import check_model_folder  # noqa: PLC0415

    try:  # before the model is loaded (a minute for a large one), not after
        mesh = MeshConfig.parse(args.mesh)
        check_model_folder(args.model, need_tokenizer=False)
        check_writable("--out", args.out, folder=True)
        weights = Path(args.out) / "weights"  # models/checkpoint.py WEIGHTS_DIR (imports JAX)
        if weights.exists():
            raise ValueError(f"--out: {weights} already exists; choose an empty folder")
    except ValueError as e:
        print(f"jaxserve convert: error: {flag_error(e)}", file=sys.stderr)
        return 2
    try:
        times = convert(args.model, args.out, args.dtype, mesh)
    except (OSError, ValueError) as e:
        # As `serve`'s start: a ValueError is a bad setting (a mesh with too few devices,
        # broken weights), 2; the system refusing (memory, a device, a disk) is 1.
        print(f"jaxserve convert: error: {e}", file=sys.stderr)
        return start_failure_code(e)
    print(
        f"wrote {args.out} (loaded safetensors in {times['load_s']:.2f} s, "
        f"saved Orbax in {times['save_s']:.2f} s)"
    )
    return 0
