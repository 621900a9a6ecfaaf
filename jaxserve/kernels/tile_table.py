"""Tile configurations of the Pallas kernels, chosen per problem shape.

This module only holds data and the rules that pick an entry; it must not import Pallas.

How the entries were chosen, and how to re-measure them
-------------------------------------------------------
No entry here has been timed yet: the session that wrote the kernels had no GPU. The
entries follow from the H100/H200 resource limits (227 KiB of shared memory and 64 Ki
32-bit registers per SM, 132 SMs; every config is checked against the SMEM limit here,
and Mosaic GPU rejects a kernel that exceeds it when lowering) and from the regimes:

- grouped matmul, few rows per expert (decode, T <= ~256 tokens at top-8 over 128
  experts): the kernel streams every expert's weights once and is bound by HBM
  bandwidth, so the row tile is the smallest wgmma allows (64), the ring is deep (more
  bytes in flight per SM) and a CTA's tiles are chained into one pipeline;
- grouped matmul, many rows per expert (prefill): compute bound, so the row tile is 128
  and each of the two compute warpgroups owns a 128 x 128 float32 accumulator (128
  registers/thread);
- paged decode attention: bound by reading K and V once; 64-key stages in the deepest
  ring that fits.

`python scripts/bench_kernels.py --sweep --out sweep.json` times every candidate in
`GMM_CANDIDATES` on Qwen3-30B-A3B expert shapes at T = 16 .. 4096 (gate, down and fused
gate+up) and the attention ring depths at the decode benchmark shapes on one GPU, and
prints the winner per token count: paste those into `_GMM_TABLE` / `_GMM_FUSED_TABLE` /
`_ATTENTION_DEFAULT`, set `FUSE_GATE_UP` from the default run's moe_ffn rows, and replace
this paragraph with the date, GPU and jax version of that measurement.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax

# Hopper (sm_90) limits the kernels are sized against.
INTERPRET_NUM_SMS = 4  # CTAs the GPU interpreter simulates (each is a CPU thread)
SMEM_BYTES_PER_SM = 227 * 1024
WGMMA_MIN_M = 64  # rows of one warpgroup MMA
NUM_COMPUTE_WARPGROUPS = 2  # the kernels split each tile's columns between two warpgroups


@dataclass(frozen=True, slots=True)
class GmmConfig:
    """Tiling of the grouped matmul kernel.

    tile_m: rows of x per tile (power of two, >= 64). A tile never spans two experts.
    tile_n: output columns per compute warpgroup; one tile covers 2 * tile_n columns.
    tile_k: contraction depth of one pipeline stage (64 bf16 = one 128-byte swizzle row).
    max_concurrent_steps: pipeline stages in flight (shared-memory buffers per operand).
    fuse_gate_up: in `moe_ffn`, compute gate and up projections in one kernel with the
        SiLU-and-multiply epilogue instead of two kernels plus an XLA elementwise op.
    chain_tiles: run the tiles of a CTA as one pipeline of pipelines, so loads of the
        next tile overlap the end of the current one (needs K / tile_k to be a multiple
        of max_concurrent_steps; ignored otherwise).
    """

    tile_m: int
    tile_n: int
    tile_k: int = 64
    max_concurrent_steps: int = 4
    fuse_gate_up: bool = False
    chain_tiles: bool = True

    def __post_init__(self):
        if self.tile_m < WGMMA_MIN_M or self.tile_m & (self.tile_m - 1):
            raise ValueError(f"tile_m must be a power of two >= 64, got {self.tile_m}")
        if self.tile_n % 64 or self.tile_n <= 0:
            raise ValueError(f"tile_n must be a positive multiple of 64, got {self.tile_n}")
        if self.tile_k % 64 or self.tile_k <= 0:
            raise ValueError(f"tile_k must be a positive multiple of 64, got {self.tile_k}")
        if self.max_concurrent_steps < 2:
            raise ValueError(f"max_concurrent_steps must be >= 2, got {self.max_concurrent_steps}")

    @property
    def block_n(self) -> int:
        """Output columns of one tile (both compute warpgroups)."""
        return NUM_COMPUTE_WARPGROUPS * self.tile_n

    def smem_bytes(self, num_weight_operands: int, itemsize: int, out_itemsize: int) -> int:
        """Shared memory the kernel allocates: pipeline buffers plus the store staging tile."""
        x_tile = self.tile_m * self.tile_k
        w_tile = self.tile_k * self.block_n
        pipeline = self.max_concurrent_steps * (x_tile + num_weight_operands * w_tile) * itemsize
        staging = self.tile_m * self.block_n * out_itemsize
        return pipeline + staging


# (max rows per expert on average, config). The first bucket that holds the shape wins.
# Unmeasured: see the module docstring.
_GMM_TABLE: tuple[tuple[float, GmmConfig], ...] = (
    (64.0, GmmConfig(tile_m=64, tile_n=64, max_concurrent_steps=8)),
    (float("inf"), GmmConfig(tile_m=128, tile_n=128, max_concurrent_steps=4)),
)

# The fused gate+up kernel keeps two accumulators per warpgroup, so it gets narrower tiles.
_GMM_FUSED_TABLE: tuple[tuple[float, GmmConfig], ...] = (
    (64.0, GmmConfig(tile_m=64, tile_n=64, max_concurrent_steps=4, fuse_gate_up=True)),
    (float("inf"), GmmConfig(tile_m=128, tile_n=64, max_concurrent_steps=4, fuse_gate_up=True)),
)

# Whether `moe_ffn` uses the fused gate+up kernel. Off until the benchmark shows it wins.
FUSE_GATE_UP = False

# Candidates that `scripts/bench_kernels.py --sweep` times (those that do not fit in
# SMEM or divide the shape are skipped there).
GMM_CANDIDATES: tuple[GmmConfig, ...] = (
    *(
        GmmConfig(tile_m=m, tile_n=n, max_concurrent_steps=s)
        for m in (64, 128)
        for n in (64, 128)
        for s in (2, 4, 6, 8)
    ),
    GmmConfig(tile_m=64, tile_n=256, max_concurrent_steps=2),
    GmmConfig(tile_m=64, tile_n=64, max_concurrent_steps=8, chain_tiles=False),
    GmmConfig(tile_m=128, tile_n=128, max_concurrent_steps=4, chain_tiles=False),
)


def _fits(width: int, config: GmmConfig) -> bool:
    return width % config.block_n == 0


def gmm_config(
    m: int,
    k: int,
    n: int,
    num_groups: int,
    *,
    fused: bool = False,
    itemsize: int = 2,
    out_itemsize: int = 2,
) -> GmmConfig:
    """Tile config for a grouped matmul x [m, k] @ w [num_groups, k, n].

    Picks the table entry for the average rows per expert, then narrows tile_n until the
    column tiles divide n, drops pipeline stages until the kernel fits in shared memory,
    and, for chained tiles, to a depth that divides the K steps.

    Raises ValueError (naming x or w) if k is not a multiple of 64 or n of 128, the
    kernel's smallest tiles, or if no pipeline depth fits in shared memory.
    """
    if k % 64:
        raise ValueError(f"x: K={k} must be a multiple of 64 (the kernel's tile_k)")
    rows_per_group = m / max(num_groups, 1)
    table = _GMM_FUSED_TABLE if fused else _GMM_TABLE
    config = next(c for limit, c in table if rows_per_group <= limit)
    while not _fits(n, config) and config.tile_n > 64:
        config = _replace(config, tile_n=config.tile_n // 2)
    if not _fits(n, config):
        raise ValueError(
            f"w: N={n} must be a multiple of {config.block_n} (two 64-column warpgroup tiles)"
        )
    operands = 2 if fused else 1
    while config.smem_bytes(operands, itemsize, out_itemsize) > SMEM_BYTES_PER_SM:
        if config.max_concurrent_steps == 2:
            raise ValueError(f"grouped matmul: no pipeline depth of {config} fits in SMEM")
        config = _replace(config, max_concurrent_steps=config.max_concurrent_steps - 1)
    # Chained tiles need the ring depth to divide the K steps: take the deepest that does,
    # unless that leaves a ring too shallow to hide HBM latency (then do not chain).
    if config.chain_tiles:
        k_steps = k // config.tile_k
        depth = config.max_concurrent_steps
        divisor = next(d for d in range(depth, 0, -1) if k_steps % d == 0)
        if divisor >= min(depth, 4):
            return _replace(config, max_concurrent_steps=divisor)
        return _replace(config, chain_tiles=False)
    return config


def _replace(config, **changes):
    fields = {f: getattr(config, f) for f in type(config).__slots__}
    fields.update(changes)
    return type(config)(**fields)


@dataclass(frozen=True, slots=True)
class AttentionConfig:
    """Tiling of the paged attention kernel.

    block_kv: keys per pipeline stage, a multiple of 64 (P = softmax(QK^T) is a wgmma
        operand in SMEM and must fill 128-byte swizzle rows) and a multiple or a divisor
        of the KV block size.
    num_stages: stages in flight in the key/value ring.
    """

    block_kv: int = 64
    num_stages: int = 4

    def __post_init__(self):
        if self.block_kv % 64 or self.block_kv <= 0:
            raise ValueError(f"block_kv must be a positive multiple of 64, got {self.block_kv}")
        if self.num_stages < 2:
            raise ValueError(f"num_stages must be >= 2, got {self.num_stages}")

    def smem_bytes(self, tile_rows: int, head_dim: int, itemsize: int) -> int:
        """Shared memory: 2 query tiles (reused to stage the output), the K and V rings,
        and P."""
        q = 2 * tile_rows * head_dim
        kv = 2 * self.num_stages * self.block_kv * head_dim
        p = tile_rows * self.block_kv
        return (q + kv + p) * itemsize


# Decode streams K and V once: 64-key stages (4 KV blocks of 16) in a 5-deep ring keep
# ~160 KiB of loads in flight per SM (HBM latency x per-SM bandwidth is ~60 KiB on
# H200). Head dim 128: 32 + 160 + 8 KiB of SMEM. Unmeasured, like the grouped matmul table.
_ATTENTION_DEFAULT = AttentionConfig(block_kv=64, num_stages=5)


def attention_config(head_dim: int, block_size: int, *, tile_rows: int = 64, itemsize: int = 2):
    """Tile config of paged attention for this head_dim and KV block size.

    Raises ValueError if no ring of >= 2 stages fits in shared memory.
    """
    config = _ATTENTION_DEFAULT
    if block_size > config.block_kv and block_size % config.block_kv:
        config = _replace(config, block_kv=block_size)
    while config.smem_bytes(tile_rows, head_dim, itemsize) > SMEM_BYTES_PER_SM:
        if config.num_stages == 2:
            raise ValueError(f"paged attention: head_dim={head_dim} does not fit in SMEM")
        config = _replace(config, num_stages=config.num_stages - 1)
    return config


def num_sms() -> int:
    """Persistent CTAs to launch: the GPU's SM count (132 on H100/H200 SXM); on the
    CPU (the interpreter) a few, so that the tests exercise several CTAs."""
    device = jax.devices()[0]
    if device.platform == "gpu":
        return int(device.core_count)
    return INTERPRET_NUM_SMS
