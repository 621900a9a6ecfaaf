"""Typed configs for the engine, KV cache, scheduler, mesh and server: one place for defaults.

This module only holds plain data; it must not import JAX (the frontend imports it).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

# The demo model ships inside the package so `jaxserve serve` with no --model serves it.
DEMO_MODEL_DIR = Path(__file__).resolve().parent / "demo_model"

logger = logging.getLogger(__name__)


def cache_root() -> Path:
    """The folder of jaxserve's caches (the JAX compilation cache is `jax_cache` in it):
    $JAXSERVE_CACHE_ROOT (as vLLM's VLLM_CACHE_ROOT), else ~/.cache/jaxserve. Read once,
    when this module is imported."""
    return Path(os.environ.get("JAXSERVE_CACHE_ROOT") or Path.home() / ".cache" / "jaxserve")


# Weight/activation dtypes the engine runs (EngineConfig.dtype); "auto" (`--dtype auto`,
# the default of `serve`) is resolved by `resolve_dtype` before the engine starts.
DTYPES = ("float32", "bfloat16", "float16")
DTYPE_CHOICES = ("auto", *DTYPES)


def resolve_dtype(dtype: str, model_dir: str | Path) -> str:
    """The engine dtype for `--dtype`: `dtype` itself, or for "auto" the checkpoint's
    (`config.json` "dtype", transformers 5.x, or "torch_dtype", 4.x; a "torch." prefix
    is dropped) when it is one of `DTYPES`, else float32. Unlike vLLM's auto, a float32
    checkpoint stays float32 (the CPU, where this project tests, has no fast half
    precision). Another torch dtype (int8, float64, float8_e4m3fn, ...) gives float32
    with a WARNING; a missing or unreadable config.json gives float32 here: the model's
    own checks report it.

    Raises ValueError naming `dtype` when it is not in `DTYPE_CHOICES`, and naming
    config.json's key when "auto" finds a string there that is no torch dtype (a typo
    such as "bfloat61" would otherwise be served as float32 without a word).
    """
    if dtype not in DTYPE_CHOICES:
        raise ValueError(f"dtype: expected one of {', '.join(DTYPE_CHOICES)}, got {dtype!r}")
    if dtype != "auto":
        return dtype
    try:
        hf = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return "float32"
    if not isinstance(hf, dict):
        return "float32"
    key = "dtype" if hf.get("dtype") else "torch_dtype"
    found = hf.get(key)
    if not isinstance(found, str):  # absent, or per sub-config (a dict): not ours to read
        return "float32"
    name = found.removeprefix("torch.")
    name = {"float": "float32", "half": "float16"}.get(name, name)  # torch's aliases
    if name in DTYPES:
        return name
    if name not in _OTHER_TORCH_DTYPES:
        raise ValueError(
            f"config.json: {key} {found!r} is not a dtype (expected one of "
            f"{', '.join(DTYPES)}); fix it or give --dtype"
        )
    logger.warning(
        "config.json: %s %s is not served; serving float32 (give --dtype to choose one of %s)",
        key, found, ", ".join(DTYPES),
    )  # fmt: skip
    return "float32"


# torch dtype names (`str(torch.dtype)` without "torch.") that the engine does not run:
# `resolve_dtype` serves such a checkpoint as float32.
_OTHER_TORCH_DTYPES = frozenset(
    "float64 double complex32 complex64 complex128 cfloat cdouble bool uint8 "
    "uint16 uint32 uint64 int8 int16 short int32 int int64 long float8_e4m3fn "
    "float8_e4m3fnuz float8_e5m2 float8_e5m2fnuz float8_e8m0fnu float4_e2m1fn_x2".split()
)


# The KV cache's share of the memory left after the weights on a GPU, by default.
DEFAULT_MEMORY_FRACTION = 0.85


@dataclass(slots=True)
class CacheConfig:
    """Paged KV cache.

    block_size: tokens per KV block.
    num_blocks: total KV blocks per dp rank; None means size from `memory_fraction`.
    memory_fraction: the fraction of the memory left after the weights that the KV cache
        takes (`--gpu-memory-utilization`), on every backend: the device's memory on a
        GPU, the host's available memory on the CPU. None: DEFAULT_MEMORY_FRACTION on a
        GPU; on the CPU enough for max_num_seqs requests of max_model_len tokens, capped
        (`model_runner.num_kv_blocks`).
    enable_prefix_caching: reuse full blocks named by their chained hash.
    """

    block_size: int = 16
    num_blocks: int | None = None
    memory_fraction: float | None = None
    enable_prefix_caching: bool = True

    def validate(self) -> None:
        """Raises ValueError naming the field (and its flag) of a block size the engine
        does not take: `block_size_error`."""
        error = block_size_error(self.block_size)
        if error:
            raise ValueError(f"block_size (--block-size): {error}")


# Tokens per KV block the engine takes: powers of two up to 256, as vLLM's --block-size
# (1, 8, ..., 256). The GPU paged-attention kernel reads a block in 8-row tiles and
# steps over keys in stages of 64 (kernels/paged_attention.py `unsupported_reason`,
# tile_table.attention_config), so it takes 8, 16, 32 and multiples of 64; 1, 2 and 4 run
# the reference attention there, with a warning. The CPU runs any size.
MAX_BLOCK_SIZE = 256
# The largest `SchedulerConfig.stream_interval` (tokens).
MAX_STREAM_INTERVAL = 1024


def block_size_error(block_size: int) -> str | None:
    """Why `block_size` is not a KV block size the engine takes, or None."""
    if block_size < 1 or block_size > MAX_BLOCK_SIZE or block_size & (block_size - 1):
        return f"must be a power of two from 1 to {MAX_BLOCK_SIZE} (default 16), got {block_size}"
    return None


@dataclass(slots=True)
class SchedulerConfig:
    """Continuous batching limits.

    max_num_seqs: most requests in one step (per dp rank).
    max_num_batched_tokens: token budget of one step (prefill chunks + decodes).
    max_model_len: most tokens (prompt + output) of one request; None = the model's.
    async_scheduling: schedule and pack step N+1 while the device runs step N (vLLM's
        `--async-scheduling`). None (the default) follows the backend, resolved once at
        start-up by `resolve_async_scheduling`: on for an accelerator, off for the CPU,
        where the device is the same two cores the host step runs on (measured by
        scripts/bench_host_step.py --sync; see that function).
    num_decode_steps: decode steps per device call when every running request is
        decoding (multi-step decode); 1 disables it. 4 measured 5-20% more output
        tokens/s than 1 on the demo model at batch 1-32 (scripts/bench_offline.py), for
        one more compiled step per row bucket.
    stream_interval: a running request's tokens are published in messages of at least
        this many (its first and final output excepted; `engine.stream_interval`); 1
        publishes every step's tokens at once.
    burst_gather_ms: an idle engine that receives a request waits while more keep
        arriving, each within this many milliseconds of the last (at most
        `engine.process.BURST_GATHER_MAX_S` in all), so that a burst is prefilled in one
        step; 0 starts at once. None (the default) follows the backend, resolved by the
        engine process (`resolve_burst_gather_ms`).
    """

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None
    enable_chunked_prefill: bool = True
    async_scheduling: bool | None = None
    num_decode_steps: int = 4
    stream_interval: int = 1
    burst_gather_ms: float | None = None


def resolve_async_scheduling(value: bool | None, platform: str) -> bool:
    """Whether the engine overlaps host and device work (`SchedulerConfig.async_scheduling`).

    value: the configured setting; True or False is kept, None follows the backend.
    platform: JAX's platform name of the engine's devices ("cpu", "gpu", "tpu", ...).

    None gives on for every accelerator (as vLLM) and off for "cpu": there the "device"
    is XLA's CPU thread pool, on the same cores as the Python host step, so overlapping
    them only makes both contend. Measured with the interleaved A/B of
    scripts/bench_host_step.py --sync on a 2-core CPU, demo model: sync 457 vs async 243
    tok/s at batch 1 and 1.02-1.04x at batch 8, 32 and 128 (load 8.8); earlier, 838 vs
    425 at batch 1 and 2317 vs 1452 at batch 8 (load 4.2).
    """
    if value is not None:
        return bool(value)
    return platform != "cpu"


# `resolve_burst_gather_ms` on the CPU: the gap (ms) within which an idle engine keeps
# taking arriving requests before its first step.
CPU_BURST_GATHER_MS = 2.0


def resolve_burst_gather_ms(value: float | None, platform: str) -> float:
    """The burst gather gap in ms (`SchedulerConfig.burst_gather_ms`): value when set,
    else CPU_BURST_GATHER_MS for "cpu" and 0 (off) for any other platform (a mock engine
    passes its own name).

    Why on the CPU: a step there costs tens of milliseconds, about as long as a burst of
    requests takes to arrive through the frontend (~1 ms of its CPU each), so without the
    gather a burst of 64 was prefilled in 3 steps, the first arrivals decoding a token a
    step meanwhile, where offline `LLM.generate` takes one. Measured (2-core CPU, random
    Qwen3-MoE, scripts/bench_serve.py with --serve-flags='--burst-gather-ms 2' or '0',
    interleaved, medians of 5, three runs): the steps fall to offline's count (42 -> 36
    at concurrency 16, 11 -> 9 at 64); tokens/s at 64 1.03 / 1.04 / 1.06x (256 requests
    a level in the last), at 16 1.07 / 0.95 / 1.03x and at 256 0.99 / 0.99x (run-to-run
    noise is about +-5%). The cost: an isolated request waits the gap (TTFT p50 at
    concurrency 1 11-14 -> 14-16 ms). On an accelerator steps are short and async
    scheduling overlaps them: off.
    """
    if value is not None:
        return float(value)
    return CPU_BURST_GATHER_MS if platform == "cpu" else 0.0


@dataclass(slots=True)
class MeshConfig:
    """Device mesh: dp (attention data parallel) x tp (tensor parallel); ep = dp * tp.

    ep_replicated_max_tokens: MoE steps of at most this many tokens (the whole flat batch
        over all dp ranks) take the replicated-token path, larger ones the all_to_all
        path (`sharding.parallel.MeshParallelism`); 0 sends every step to all_to_all.
        None (the default) measures it at start-up on the engine's own mesh and step
        sizes (`sharding.ep_calibration`): two compilations and timings per step size,
        and a choice that follows the timing noise. Given, start-up skips the measurement
        and every run takes the same paths (with several processes, give each the same
        value, as every engine flag). Unused on one device and for dense models.
    """

    dp: int = 1
    tp: int = 1
    ep_replicated_max_tokens: int | None = None

    def validate(self) -> None:
        """Raises ValueError naming the field (and its flag) of an out-of-range value."""
        threshold = self.ep_replicated_max_tokens
        if threshold is not None and (not isinstance(threshold, int) or threshold < 0):
            raise ValueError(
                "mesh.ep_replicated_max_tokens (--ep-replicated-max-tokens): must be an "
                f"integer >= 0 tokens, or None to measure it at start-up, got {threshold!r}"
            )

    @classmethod
    def parse(cls, text: str) -> MeshConfig:
        """Parse "dp=2,tp=4". Raises ValueError naming the bad part."""
        values = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, sep, value = part.partition("=")
            if not sep or key not in ("dp", "tp") or not value.isdigit() or int(value) < 1:
                raise ValueError(f"mesh: expected 'dp=D,tp=T' with positive integers, got {part!r}")
            values[key] = int(value)
        return cls(**values)

    @property
    def size(self) -> int:
        return self.dp * self.tp


@dataclass(slots=True)
class EplbConfig:
    """Expert-parallel load balancing (EPLB) of MoE models on a mesh, as vLLM's
    `--enable-eplb` (vllm/distributed/eplb/eplb_state.py).

    enabled: re-place experts from their measured load every `step_interval` engine
        steps. Needs an expert-parallel mesh (dp * tp > 1): on one device the engine
        logs a warning and runs without it. With several processes the leader plans
        and every process applies each new placement between the same two steps.
    num_redundant_experts: R, extra expert slots per MoE layer (S = E + R physical
        slots, S divisible by dp * tp) holding replicas of hot experts. They start as
        replicas of experts 0..R-1 and cost R experts' weights per layer. Used on any
        expert-parallel mesh, with or without `enabled`.
    window_size: engine steps of the expert-load window the plan is made from.
    step_interval: engine steps between two re-placement checks (steps, not tokens).
    min_improvement: a layer is re-placed only if its plan lowers the most loaded
        device's load by more than this fraction, in [0, 1) (load windows are noisy:
        a small gain is not worth moving weights).
    """

    enabled: bool = False
    num_redundant_experts: int = 0
    window_size: int = 1000
    step_interval: int = 3000
    min_improvement: float = 0.05

    def validate(self) -> None:
        """Raises ValueError naming the field of an out-of-range value."""
        if self.num_redundant_experts < 0:
            raise ValueError(
                "eplb.num_redundant_experts (--num-redundant-experts): must be >= 0, "
                f"got {self.num_redundant_experts}"
            )
        if self.window_size < 1:
            raise ValueError(
                f"eplb.window_size (--eplb-window-size): must be >= 1 steps, got {self.window_size}"
            )
        if self.step_interval < 1:
            raise ValueError(
                "eplb.step_interval (--eplb-step-interval): must be >= 1 steps, "
                f"got {self.step_interval}"
            )
        if not 0.0 <= self.min_improvement < 1.0:
            raise ValueError(
                "eplb.min_improvement (--eplb-min-improvement): must be in [0, 1), "
                f"got {self.min_improvement}"
            )

    def for_mesh(self, mesh_size: int) -> EplbConfig:
        """What runs on a mesh of mesh_size devices: on one device there is no expert
        parallelism to balance, so EPLB is off and there are no redundant experts."""
        if mesh_size == 1 and (self.enabled or self.num_redundant_experts):
            return dataclasses.replace(self, enabled=False, num_redundant_experts=0)
        return self


@dataclass(slots=True)
class EngineConfig:
    """Everything the engine process needs to start."""

    model: str = str(DEMO_MODEL_DIR)  # a local folder (a Hub id is resolved before)
    dtype: str = "float32"  # activation/weight dtype, one of DTYPES
    # The name reported in stats, GetServerInfo and metrics; None: the folder's name.
    served_model_name: str | None = None
    seed: int = 0
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    eplb: EplbConfig = field(default_factory=EplbConfig)
    # Compile all but the smallest step shapes in the background while serving, under a
    # smaller step budget until they are ready (jaxserve/engine/warmup.py); `serve` turns
    # it on, the offline LLM and tests compile everything before the first step.
    background_compile: bool = False
    # JAX persistent compilation cache; None disables it.
    compilation_cache_dir: str | None = str(cache_root() / "jax_cache")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> EngineConfig:
        d = dict(d)
        return cls(
            cache=CacheConfig(**d.pop("cache", {})),
            scheduler=SchedulerConfig(**d.pop("scheduler", {})),
            mesh=MeshConfig(**d.pop("mesh", {})),
            eplb=EplbConfig(**d.pop("eplb", {})),
            **d,
        )


@dataclass(slots=True)
class ServerConfig:
    """The frontend: gRPC, and the OpenAI HTTP API when http_port is set."""

    host: str = "127.0.0.1"
    port: int = 50051
    # Prometheus /metrics over HTTP on host:metrics_port; None disables it.
    metrics_port: int | None = None
    # The OpenAI-compatible HTTP API on host:http_port; None disables it.
    http_port: int | None = None
    # A chat template file replacing the model folder's (frontend/http/chat_template.py).
    chat_template: str | None = None
    # Seconds between the stats log lines while serving (jaxserve.serve_log); 0 disables.
    stats_log_interval_s: float = 10.0
