"""`ModelRunner`: turns a scheduler decision into one compiled device call.

Owns the device side of the engine: the model's parameters, the paged KV cache, the
bucketed step functions and the host-side packing of their inputs. One step is one
jitted call that runs the model over the flat batch, the LM head on the last token of
each request row, and the sampler, so only [R] token ids (and log-probs) come back.

Shapes a request can choose never reach the compiler: every step is padded to a token
bucket T (powers of two up to max_num_batched_tokens). The request-row count is tied to
it, R = min(T, max_num_seqs): a step of n tokens has at most n rows, and a padded row
costs only one row of the sampler, so one row bucket per T is enough. Each T has two
variants: the plain step, and one that carries the sampler's penalty history (L =
max_model_len) for the rare steps with a penalized row. All 2 x len(T) executables are
compiled ahead of time at start-up (`jax.jit(...).lower(...).compile()`, as vLLM's
tpu-inference precompiles its padded shapes); calling an executable with any other shape
raises instead of compiling. The KV cache is donated to each call, so XLA updates it in
place.
"""

from __future__ import annotations

import logging
import math
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.engine import sampler as sampler_lib
from jaxserve.engine.scheduler import SchedulerOutput, StepSamples
from jaxserve.models.base import PAD_SLOT, AttentionMetadata, KVCache, allocate_kv_cache
from jaxserve.models.config import ModelConfig

logger = logging.getLogger(__name__)

MIN_TOKEN_BUCKET = 16
# On the CPU (no device memory statistics) the KV cache gets at most this many bytes.
CPU_KV_CACHE_BYTES = 256 * 2**20


def pow2_buckets(smallest: int, largest: int) -> tuple[int, ...]:
    """Powers of two from `smallest` (capped at `largest`) up to `largest`, plus `largest`.

    E.g. (16, 100) -> (16, 32, 64, 100); (8, 4) -> (4,).
    """
    buckets, b = [], min(smallest, largest)
    while b < largest:
        buckets.append(b)
        b *= 2
    buckets.append(largest)
    return tuple(buckets)


def pick_bucket(buckets: tuple[int, ...], n: int) -> int:
    """The smallest bucket >= n. Raises ValueError when n exceeds the largest."""
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


def kv_block_bytes(config: ModelConfig, block_size: int, dtype: jnp.dtype) -> int:
    """Bytes of one KV block over all layers (K and V)."""
    per_layer = block_size * config.num_key_value_heads * config.head_dim
    return 2 * config.num_hidden_layers * per_layer * jnp.dtype(dtype).itemsize


def num_kv_blocks(
    config: ModelConfig,
    block_size: int,
    dtype: jnp.dtype,
    memory_fraction: float,
    max_num_seqs: int,
    max_model_len: int,
    device: jax.Device | None = None,
) -> int:
    """How many KV blocks (null block included) to allocate when the user did not say.

    On a device with memory statistics: `memory_fraction` of the memory still free after
    the weights. Elsewhere (the CPU): enough for `max_num_seqs` requests of
    `max_model_len` tokens, capped at CPU_KV_CACHE_BYTES.
    """
    per_block = kv_block_bytes(config, block_size, dtype)
    device = device or jax.devices()[0]
    stats = device.memory_stats() if device.platform != "cpu" else None
    if stats and "bytes_limit" in stats:
        free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
        return max(2, int(free * memory_fraction) // per_block)
    wanted = max_num_seqs * math.ceil(max_model_len / block_size) + 1
    return max(2, min(wanted, CPU_KV_CACHE_BYTES // per_block))


class CompileCounter:
    """Counts XLA executables built in this process (persistent-cache hits included),
    through JAX's monitoring events. One listener for the process, installed once."""

    count = 0
    _installed = False

    @classmethod
    def install(cls) -> None:
        if not cls._installed:
            jax.monitoring.register_event_duration_secs_listener(cls._on_event)
            cls._installed = True

    @classmethod
    def _on_event(cls, event: str, duration: float, **kwargs) -> None:
        if event == BACKEND_COMPILE_EVENT:
            cls.count += 1


# The event JAX records around every backend compilation (jax/_src/dispatch.py).
BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


def enable_compilation_cache(cache_dir: str | None) -> None:
    """Turn on JAX's persistent compilation cache in `cache_dir` (None: leave it off).

    Every executable is cached, however fast it compiled: start-up compiles dozens of
    small buckets and a warm restart should load all of them.
    """
    if not cache_dir:
        return
    os.makedirs(cache_dir, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


@dataclass(slots=True)
class StepInputs:
    """Host (NumPy) inputs of one step, padded to bucket (T, R, L)."""

    tokens: np.ndarray  # [T] int32
    positions: np.ndarray  # [T] int32
    metadata: AttentionMetadata  # NumPy fields, see models/base.py
    logits_indices: np.ndarray  # [R] int32: flat index of each row's last token
    sampling: sampler_lib.SamplingMetadata
    bucket: tuple[int, int, int]  # (T, R, L)
    num_rows: int  # real (unpadded) rows


class ModelRunner:
    """Compiled step functions over a model and its paged KV cache.

    Args:
        model: an NNX model following models/base.py's CausalLM contract.
        model_config: its ModelConfig.
        num_blocks: KV blocks to allocate (block 0 is the null block).
        block_size: tokens per KV block.
        max_model_len: most tokens of one request (sets the block-table width).
        max_num_seqs: most request rows per step (the largest request bucket).
        max_num_batched_tokens: most tokens per step (the largest token bucket).
        kv_dtype: dtype of the KV cache.
    """

    def __init__(
        self,
        model: nnx.Module,
        model_config: ModelConfig,
        *,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        kv_dtype: jnp.dtype = jnp.float32,
    ):
        self.config = model_config
        self.vocab_size = model_config.vocab_size
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_blocks_per_seq = math.ceil(max_model_len / block_size)
        self.max_num_seqs = max_num_seqs
        self.token_buckets = pow2_buckets(MIN_TOKEN_BUCKET, max_num_batched_tokens)
        self.graphdef, self.state = nnx.split(model)
        c = model_config
        self.kv_cache: KVCache = allocate_kv_cache(
            c.num_hidden_layers, num_blocks, block_size, c.num_key_value_heads, c.head_dim, kv_dtype
        )
        self._jitted = jax.jit(self._step_fn(), donate_argnums=(1,))
        self._executables: dict[tuple[int, int, int], jax.stages.Compiled] = {}
        # Host vs device time of the last step, seconds (the metrics layer exports them).
        self.last_prepare_s = 0.0
        self.last_device_s = 0.0

    # ----- compilation -------------------------------------------------------------------

    def buckets(self) -> list[tuple[int, int, int]]:
        """Every (T, R, L) a step can use: per token bucket T, R = `rows_for(T)` and the
        penalty history L = 0 (plain) or max_model_len (a step with a penalized row)."""
        histories = (0, self.max_model_len)
        return [(t, self.rows_for(t), h) for h in histories for t in self.token_buckets]

    def rows_for(self, t_bucket: int) -> int:
        """The row bucket of token bucket T: enough for any step of at most T tokens."""
        return min(t_bucket, self.max_num_seqs)

    def compile_all(self, max_workers: int | None = None) -> float:
        """Compile the step for every bucket. Returns the seconds taken.

        Tracing runs in this thread (it is Python); XLA compilations run in parallel
        threads (they release the GIL), `max_workers` at a time (default: CPU count).
        """
        start = time.perf_counter()
        buckets = self.buckets()
        lowered = [self._lower(b) for b in buckets]
        workers = max_workers or min(len(buckets), os.cpu_count() or 1)
        with ThreadPoolExecutor(max_workers=workers) as pool:
            compiled = list(pool.map(lambda low: low.compile(), lowered))
        self._executables = dict(zip(buckets, compiled, strict=True))
        elapsed = time.perf_counter() - start
        logger.info("compiled %d step buckets in %.1f s", len(buckets), elapsed)
        return elapsed

    def _lower(self, bucket: tuple[int, int, int]) -> jax.stages.Lowered:
        inputs = self._empty_inputs(*bucket)
        return self._jitted.lower(
            self.state,
            self.kv_cache,
            inputs.tokens,
            inputs.positions,
            inputs.metadata,
            inputs.logits_indices,
            inputs.sampling,
        )

    def _step_fn(self):
        graphdef = self.graphdef

        def step(state, kv_cache, tokens, positions, metadata, logits_indices, sampling_md):
            model = nnx.merge(graphdef, state)
            hidden, kv_cache = model(tokens, positions, kv_cache, metadata)
            logits = model.compute_logits(hidden[logits_indices])
            return sampler_lib.sample(logits, sampling_md, sampler_lib.K_MAX), kv_cache

        return step

    # ----- one step ----------------------------------------------------------------------

    def prepare(self, sched: SchedulerOutput) -> StepInputs:
        """Pack a scheduler decision into padded NumPy inputs.

        Raises:
            ValueError: the step exceeds the largest bucket (a scheduler bug).
        """
        reqs = sched.requests
        t_bucket = pick_bucket(self.token_buckets, sched.num_tokens)
        r_bucket = self.rows_for(t_bucket)
        if len(reqs) > r_bucket:
            raise ValueError(f"{len(reqs)} rows exceed the {r_bucket} rows of bucket T={t_bucket}")
        rows = [
            sampler_lib.SamplingRow(
                r.seq.params, r.seq.prompt_token_ids, r.seq.output_token_ids, r.seq.seed
            )
            for r in reqs
        ]
        h_bucket = self.max_model_len if sampler_lib.history_len_needed(rows) > 0 else 0
        x = self._empty_inputs(t_bucket, r_bucket, h_bucket)
        md = x.metadata
        bs = self.block_size
        t = 0
        for row, r in enumerate(reqs):
            n, table = r.num_tokens, r.seq.block_table
            pos = np.arange(r.start, r.start + n, dtype=np.int32)
            x.tokens[t : t + n] = r.seq.token_ids[r.start : r.start + n]
            x.positions[t : t + n] = pos
            md.slot_mapping[t : t + n] = np.asarray(table, np.int32)[pos // bs] * bs + pos % bs
            md.token_req[t : t + n] = row
            md.block_tables[row, : len(table)] = table
            md.seq_lens[row] = r.start + n
            md.query_start_loc[row] = t
            t += n
            x.logits_indices[row] = t - 1
        md.query_start_loc[len(reqs) :] = t
        x.sampling = sampler_lib.prepare_sampling_metadata(
            rows, r_bucket, self.vocab_size, h_bucket
        )
        x.num_rows = len(reqs)
        return x

    def _empty_inputs(self, t_bucket: int, r_bucket: int, h_bucket: int) -> StepInputs:
        # Padded tokens write nowhere (PAD_SLOT) and belong to the last row, whose outputs
        # are ignored when it is padding and unaffected when it is real (they are masked
        # by query_start_loc).
        metadata = AttentionMetadata(
            slot_mapping=np.full(t_bucket, PAD_SLOT, np.int32),
            block_tables=np.zeros((r_bucket, self.max_blocks_per_seq), np.int32),
            seq_lens=np.zeros(r_bucket, np.int32),
            query_start_loc=np.zeros(r_bucket + 1, np.int32),
            token_req=np.full(t_bucket, r_bucket - 1, np.int32),
        )
        return StepInputs(
            tokens=np.zeros(t_bucket, np.int32),
            positions=np.zeros(t_bucket, np.int32),
            metadata=metadata,
            logits_indices=np.zeros(r_bucket, np.int32),
            sampling=sampler_lib.prepare_sampling_metadata([], r_bucket, self.vocab_size, h_bucket),
            bucket=(t_bucket, r_bucket, h_bucket),
            num_rows=0,
        )

    def execute(self, sched: SchedulerOutput) -> StepSamples:
        """Run one step on the device and bring the sampled tokens back to the host.

        Returns:
            StepSamples with row r for sched.requests[r].
        """
        start = time.perf_counter()
        x = self.prepare(sched)
        executable = self._executables.get(x.bucket)
        if executable is None:
            raise RuntimeError(f"bucket {x.bucket} was not compiled; call compile_all() first")
        dispatched = time.perf_counter()
        out, self.kv_cache = executable(
            self.state,
            self.kv_cache,
            x.tokens,
            x.positions,
            x.metadata,
            x.logits_indices,
            x.sampling,
        )
        n = x.num_rows
        want_logprobs = any(r.seq.params.logprobs is not None for r in sched.requests)
        if want_logprobs:
            token_ids, logprobs, top_ids, top_lps = jax.device_get(
                (out.token_ids, out.logprobs, out.top_token_ids, out.top_logprobs)
            )
            samples = StepSamples(token_ids[:n], logprobs[:n], top_ids[:n], top_lps[:n])
        else:
            samples = StepSamples(np.asarray(jax.device_get(out.token_ids))[:n])
        done = time.perf_counter()
        self.last_prepare_s = dispatched - start
        self.last_device_s = done - dispatched
        return samples
