"""Device peaks: the memory bandwidth and FLOP rate MBU and MFU are measured against.

One table, `PEAKS`, per device kind (matched as a substring of JAX's `device_kind`, most
specific first), from the vendors' data sheets: HBM bandwidth in bytes/s and dense
(no sparsity) matmul FLOP/s per dtype. On the CPU there is no data sheet: `cpu_ceiling`
measures one on this host at start-up (numpy, not JAX, so the engine's count of XLA
compilations after warm-up stays 0): the best of a few large array copies (bytes read +
written per second) and of a few float32 matrix products (2 n^3 FLOPs per product).
No JAX import at module level; `device_peak` takes the device kind as a string.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class Peak:
    """One device's peaks. bytes_per_s: memory bandwidth. flops_per_s: dtype name ->
    dense matmul FLOP/s (bfloat16 / float16 on the tensor cores, float32 without TF32)."""

    bytes_per_s: float
    flops_per_s: dict[str, float]
    # Measured on this host (`cpu_ceiling`), not a data-sheet figure: a lower bound, which a
    # faster step may raise (`step_cost.StepMeter`).
    measured: bool = False

    def flops(self, dtype: str) -> float:
        """Peak FLOP/s for `dtype` (float32 when the dtype is not in the table)."""
        return self.flops_per_s.get(dtype, self.flops_per_s["float32"])


def _p(bw_tb: float, bf16_tf: float, fp32_tf: float) -> Peak:
    bf16 = bf16_tf * 1e12
    return Peak(bw_tb * 1e12, {"bfloat16": bf16, "float16": bf16, "float32": fp32_tf * 1e12})


# device_kind substring -> peak; the first match wins (so "H100 PCIe" before "H100").
# Sources: NVIDIA H200 / H100 / A100 / L4 data sheets (SXM unless named), Google Cloud TPU
# system-architecture pages (v4, v5e, v5p, v6e).
PEAKS: tuple[tuple[str, Peak], ...] = (
    ("H200", _p(4.8, 989.0, 67.0)),
    ("H100 PCIe", _p(2.0, 756.0, 51.0)),
    ("H100", _p(3.35, 989.0, 67.0)),
    ("A100-SXM4-80GB", _p(2.039, 312.0, 19.5)),
    ("A100", _p(1.555, 312.0, 19.5)),
    ("L4", _p(0.3, 121.0, 30.3)),
    ("TPU v6", _p(1.64, 918.0, 918.0)),
    ("TPU v5p", _p(2.765, 459.0, 459.0)),
    ("TPU v5 lite", _p(0.819, 197.0, 197.0)),
    ("TPU v5e", _p(0.819, 197.0, 197.0)),
    ("TPU v4", _p(1.2, 275.0, 275.0)),
)  # fmt: skip


def device_peak(device_kind: str) -> Peak | None:
    """The table's peak of one device of kind `device_kind` (JAX's `Device.device_kind`,
    e.g. "NVIDIA H200"), or None for a kind not in `PEAKS` (the CPU among them)."""
    for key, peak in PEAKS:
        if key.lower() in device_kind.lower():
            return peak
    return None


_CPU_CEILING: Peak | None = None


def cpu_ceiling(copy_mib: int = 64, matmul_n: int = 512, repeats: int = 10) -> Peak:
    """A measured ceiling of this host (cached after the first call, ~0.1 s): bandwidth
    from copying a `copy_mib` MiB float32 array (2x its bytes moved per copy), FLOP/s
    from `matmul_n`-square float32 products after one untimed product (BLAS starts its
    threads); the best of `repeats` runs of each. Best of many, because it runs at
    start-up beside compiles and other processes: on a busy 2-core host single 512
    products measured 20-210 GFLOP/s, and best of 3 without the warm-up once gave a peak
    so low that `diagnose` reported an MFU of 1.1. The same rate serves every dtype (the
    CPU backend computes in float32)."""
    global _CPU_CEILING
    if _CPU_CEILING is not None:
        return _CPU_CEILING
    a = np.ones(copy_mib * 2**20 // 4, np.float32)
    b = np.empty_like(a)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        np.copyto(b, a)
        best = min(best, time.perf_counter() - t)
    bandwidth = 2 * a.nbytes / best
    x = np.ones((matmul_n, matmul_n), np.float32)
    x @ x
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        x @ x
        best = min(best, time.perf_counter() - t)
    flops = 2 * matmul_n**3 / best
    _CPU_CEILING = Peak(
        bandwidth, {"bfloat16": flops, "float16": flops, "float32": flops}, measured=True
    )
    return _CPU_CEILING


def mesh_peak(device_kind: str, num_devices: int, platform: str) -> Peak | None:
    """The peak of a mesh of `num_devices` devices of one kind: the table's per-device
    peak times num_devices; on the CPU (emulated devices share the host's cores and
    memory) the host's measured ceiling, not multiplied. None for an unknown accelerator."""
    if platform == "cpu":
        return cpu_ceiling()
    peak = device_peak(device_kind)
    if peak is None:
        return None
    return Peak(
        peak.bytes_per_s * num_devices,
        {k: v * num_devices for k, v in peak.flops_per_s.items()},
    )


def engine_peak(mesh) -> Peak | None:
    """`mesh_peak` of the devices a step runs on: those of `mesh` (a jax Mesh; one device
    is a 1x1 mesh, `engine.builder`)."""
    devices = list(mesh.devices.flat)
    d = devices[0]
    return mesh_peak(d.device_kind, len(devices), d.platform)
