"""FP8 block-quantized checkpoints as DeepSeek publishes them, dequantized at load.

config.json carries `quantization_config = {"quant_method": "fp8", "fmt": "e4m3",
"weight_block_size": [128, 128], "activation_scheme": "dynamic"}`; each quantized
linear weight W [out, in] is stored as float8_e4m3fn with a float32
`<name>_scale_inv` [ceil(out / 128), ceil(in / 128)], and the real weight is
W[i, j] * scale_inv[i // 128, j // 128] (DeepSeek-V3's `inference/kernel.py`
`weight_dequant`; the last blocks of a dimension may be partial). Norms, the embedding,
the gate and the LM head stay in bf16/fp32.

The loader dequantizes tensor by tensor to float32 on the host (`dequantize_block`), then
casts to the serving dtype: serving runs in bf16/fp32, not FP8 matmuls (no FP8 kernel
here yet). NumPy has no FP8 dtype and safetensors' NumPy reader refuses F8 tensors, so
`read_raw` reads their bytes from the file (header + offset) as ml_dtypes' float8.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

SCALE_SUFFIX = "_scale_inv"
DEFAULT_BLOCK = (128, 128)
# safetensors dtype names that NumPy cannot read, with their ml_dtypes equivalents.
RAW_DTYPES = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2}


def weight_block(hf: dict[str, Any]) -> tuple[int, int] | None:
    """The (rows, cols) scale block of an FP8 checkpoint's config.json, None if the
    checkpoint is not quantized.

    Raises:
        ValueError: another `quantization_config.quant_method` or FP8 format, or a bad
            `weight_block_size` (named).
    """
    q = hf.get("quantization_config")
    if not q:
        return None
    method = q.get("quant_method")
    if method != "fp8":
        raise ValueError(
            f"config.json: quantization_config.quant_method={method!r} is not supported "
            "(only 'fp8' block-quantized weights)"
        )
    fmt = q.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"config.json: quantization_config.fmt={fmt!r} is not supported (e4m3)")
    block = q.get("weight_block_size") or DEFAULT_BLOCK
    if len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block):
        raise ValueError(
            f"config.json: quantization_config.weight_block_size must be two positive "
            f"integers, got {block!r}"
        )
    return int(block[0]), int(block[1])


def dequantize_block(
    weight: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int]
) -> np.ndarray:
    """W [out, in] (any float dtype, FP8 included) times its per-block scale -> float32.

    scale_inv: [ceil(out / block[0]), ceil(in / block[1])] float32.

    Raises:
        ValueError: scale_inv's shape does not match the weight and block.
    """
    rows, cols = weight.shape
    br, bc = block
    expected = (-(-rows // br), -(-cols // bc))
    if tuple(scale_inv.shape) != expected:
        raise ValueError(
            f"FP8 scale shape {tuple(scale_inv.shape)} != {expected} for a weight of "
            f"{(rows, cols)} in blocks of {block}"
        )
    scale = np.repeat(np.repeat(scale_inv.astype(np.float32), br, axis=0), bc, axis=1)
    return weight.astype(np.float32) * scale[:rows, :cols]


class RawReader:
    """Tensors of dtypes NumPy lacks (FP8), read straight from a safetensors file."""

    def __init__(self):
        self._headers: dict[Path, tuple[int, dict]] = {}

    def _header(self, file: Path) -> tuple[int, dict]:
        if file not in self._headers:
            with open(file, "rb") as f:
                (size,) = struct.unpack("<Q", f.read(8))
                self._headers[file] = (8 + size, json.loads(f.read(size)))
        return self._headers[file]

    def read(self, file: Path, name: str) -> np.ndarray:
        """The tensor `name` of `file` as an ml_dtypes array (a copy, not a memory map)."""
        base, header = self._header(file)
        info = header[name]
        dtype = RAW_DTYPES[info["dtype"]]
        start, end = info["data_offsets"]
        data = np.fromfile(file, dtype=np.uint8, count=end - start, offset=base + start)
        return data.view(dtype).reshape(info["shape"])
