"""`ModelRunner`: turns a scheduler decision into one compiled device call.

Owns the device side of the engine: the model's parameters, the paged KV cache and the
compiled step functions. One step is one jitted call that runs the model over the flat
batch (packed by `step_inputs.InputBuilder`), the LM head on the last token of each
request row, and the sampler, so only [R] token ids (and log-probs) come back.

Shapes a request can choose never reach the compiler: every step is padded to a token
bucket T (powers of two up to max_num_batched_tokens). The request-row count is tied to
it, R = min(T, max_num_seqs): a step of n tokens has at most n rows, and a padded row
costs only one row of the sampler, so one row bucket per T is enough. Each T has two
variants: the plain step, and a "full" one for the rare steps that need more: the
sampler's penalty history (L = max_model_len) and the logits of every token, for prompt
log-probs. With multi-step decode on, one more call per row bucket runs several decode
steps in a `lax.scan`. Every executable is compiled ahead of time at start-up
(`jax.jit(...).lower(...).compile()`, as vLLM's tpu-inference precompiles its padded
shapes); calling one with any other shape raises instead of compiling. The KV cache is
donated to each call, so XLA updates it in place.

Calls are asynchronous: `dispatch` returns as soon as the step is queued (JAX's async
dispatch), and `fetch` waits for its tokens, so the engine can schedule the next step
meanwhile.

Every step also returns the expert load of its MoE layers (tokens routed to each expert
slot, padding excluded); `fetch` copies it with the sampled tokens, in the same transfer,
into `expert_load` (an `eplb.recorder.ExpertLoadRecorder`), for EPLB and the metrics.
EPLB re-places experts between steps through `expert_weights`, `physical_to_logical` and
`set_expert_placement`, which swap new arrays of the same shapes and shardings into the
parameter list the compiled steps take (no recompile).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.config import DEFAULT_MEMORY_FRACTION
from jaxserve.engine import sampler as sampler_lib
from jaxserve.engine.dp_scheduler import DPSchedulerOutput
from jaxserve.engine.outputs import StepSamples
from jaxserve.engine.scheduler import SchedulerOutput
from jaxserve.engine.sequence import Sequence
from jaxserve.engine.step_inputs import (
    DeviceInputs,
    DPStepInputs,
    InputBuilder,
    PackedLayout,
    StepInputs,
    StepShape,
    pow2_buckets,
)
from jaxserve.eplb.recorder import DEFAULT_WINDOW, ExpertLoadRecorder
from jaxserve.logs import ProgressLog
from jaxserve.models.base import PAD_SLOT, KVCache, allocate_kv_cache
from jaxserve.models.config import ModelConfig
from jaxserve.sharding.rules import batch_sharding, kv_cache_sharding, replicated

logger = logging.getLogger(__name__)

MIN_TOKEN_BUCKET = 16
# On the CPU (no device memory statistics) the KV cache gets at most this many bytes.
CPU_KV_CACHE_BYTES = 256 * 2**20


def kv_block_bytes(config: ModelConfig, block_size: int, dtype: jnp.dtype) -> int:
    """Bytes of one KV block over all layers (K and V)."""
    per_layer = block_size * config.num_key_value_heads * config.head_dim
    return 2 * config.num_hidden_layers * per_layer * jnp.dtype(dtype).itemsize


def num_kv_blocks(
    config: ModelConfig,
    block_size: int,
    dtype: jnp.dtype,
    memory_fraction: float | None,
    max_num_seqs: int,
    max_model_len: int,
    device: jax.Device | None = None,
    kv_head_shards: int = 1,
) -> int:
    """How many KV blocks (null block included) to allocate when the user did not say.

    On a device with memory statistics: `memory_fraction` (None: DEFAULT_MEMORY_FRACTION)
    of the memory still free after the weights. Elsewhere (the CPU): with a
    `memory_fraction`, that fraction of the host's available memory (`os.sysconf`
    SC_AVPHYS_PAGES); without, enough for `max_num_seqs` requests of `max_model_len`
    tokens, capped at CPU_KV_CACHE_BYTES. On a mesh this is the count of
    one dp rank, whose devices each hold 1 / kv_head_shards (tp) of every block.
    """
    per_block = kv_block_bytes(config, block_size, dtype) // kv_head_shards
    device = device or jax.devices()[0]
    stats = device.memory_stats() if device.platform != "cpu" else None
    if stats and "bytes_limit" in stats:
        free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
        fraction = DEFAULT_MEMORY_FRACTION if memory_fraction is None else memory_fraction
        return max(2, int(free * fraction) // per_block)
    if memory_fraction is not None:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        return max(2, int(available * memory_fraction) // per_block)
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


@jax.tree_util.register_dataclass
@dataclass
class StepOutput:
    """What one call returns, S = decode steps, R rows, P prompt positions, K = K_MAX.

    token_ids / logprobs: [S, R]; top_token_ids / top_logprobs: [S, R, K];
    prompt_logprobs: [P]; prompt_top_ids / prompt_top_logprobs: [P, K] (P = 0 unless
    the step is a full variant); expert_counts: [M, E_slots] int32, tokens routed to each
    expert slot of each MoE layer, summed over the S decode steps, real tokens only
    ([0, 0] without MoE layers; see `DecoderOnlyLM.forward_with_expert_counts`).
    """

    token_ids: jax.Array
    logprobs: jax.Array
    top_token_ids: jax.Array
    top_logprobs: jax.Array
    prompt_logprobs: jax.Array
    prompt_top_ids: jax.Array
    prompt_top_logprobs: jax.Array
    expert_counts: jax.Array


@dataclass(slots=True)
class StepHandle:
    """A dispatched step: its (possibly still running) device outputs and its inputs."""

    out: StepOutput
    inputs: StepInputs | DPStepInputs


class ModelRunner:
    """Compiled step functions over a model and its paged KV cache.

    Args:
        model: an NNX model following models/base.py's CausalLM contract.
        model_config: its ModelConfig.
        num_blocks: KV blocks to allocate (block 0 is the null block).
        block_size: tokens per KV block.
        max_model_len: most tokens of one request (sets the block-table width).
        max_num_seqs: most request rows per step.
        max_num_batched_tokens: most tokens per step (the largest token bucket).
        kv_dtype: dtype of the KV cache.
        num_decode_steps: decode steps of the multi-step decode call (1: not compiled).
        mesh: the (dp, tp) mesh the model is sharded on (None: one device). The KV cache
            then holds dp ranks' pools of num_blocks // dp blocks each, and every step is
            the dp ranks' inputs concatenated (DP attention; see `prepare`).
        expert_load_window: steps of the expert-load window (`expert_load`).

    Attributes:
        expert_load: the `ExpertLoadRecorder` every fetched step's expert counts go into
            (EP ranks = the mesh's devices), or None for a model without MoE layers.
        moe_layers: decoder-layer index of each row of the expert counts.
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
        num_decode_steps: int = 1,
        mesh: jax.sharding.Mesh | None = None,
        expert_load_window: int = DEFAULT_WINDOW,
    ):
        self.config = model_config
        self.mesh = mesh
        self.dp = 1 if mesh is None else mesh.shape["dp"]
        if num_blocks % self.dp:
            raise ValueError(f"num_blocks: {num_blocks} is not divisible by dp={self.dp}")
        self.vocab_size = model_config.vocab_size
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.token_buckets = pow2_buckets(MIN_TOKEN_BUCKET, max_num_batched_tokens)
        self.builder = InputBuilder(
            self.token_buckets,
            max_num_seqs,
            max_model_len,
            block_size,
            model_config.vocab_size,
            num_decode_steps,
        )
        self.max_blocks_per_seq = self.builder.max_blocks_per_seq
        self.moe_layers: tuple[int, ...] = model.moe_layers()
        self.expert_load: ExpertLoadRecorder | None = None
        if self.moe_layers:
            self.expert_load = ExpertLoadRecorder(
                len(self.moe_layers),
                model.num_expert_slots,
                ep=1 if mesh is None else mesh.size,
                window=expert_load_window,
            )
        self.graphdef, self.state = nnx.split(model)
        # Steps take the parameters as a flat list: flattening the nested NNX state on
        # every call costs milliseconds of host time per step.
        self._params, self._params_def = jax.tree.flatten(self.state)
        self._param_index = _leaf_index(self.state)
        c = model_config
        self.kv_cache: KVCache = allocate_kv_cache(
            c.num_hidden_layers,
            num_blocks,
            block_size,
            c.num_key_value_heads,
            c.head_dim,
            kv_dtype,
            sharding=None if mesh is None else kv_cache_sharding(mesh),
        )
        # Where step inputs go (leading axis over dp) and outputs come back (replicated).
        self._input_sharding = None if mesh is None else batch_sharding(mesh, 1)
        self._output_sharding = None if mesh is None else replicated(mesh)
        self._executables: dict[StepShape, jax.stages.Compiled] = {}
        # Rows of the last dispatched step: where its sampled tokens are found.
        self._last_rows: dict[Sequence, int] = {}
        self._last_rank_rows: list[dict[Sequence, int]] = [{} for _ in range(self.dp)]
        # Host time to pack the last step, and time blocked waiting for its outputs (s).
        self.last_prepare_s = 0.0
        self.last_wait_s = 0.0
        # Multi-process leader: called with (buffers, shape) before each dispatch, so the
        # followers run the same step (`jaxserve.step_channel.StepPublisher`).
        self.publish: Callable[[tuple[np.ndarray, ...], StepShape], None] | None = None

    # ----- compilation -------------------------------------------------------------------

    def buckets(self) -> list[StepShape]:
        """Every step shape start-up compiles (see `InputBuilder.shapes`)."""
        return self.builder.shapes()

    def rows_for(self, t_bucket: int) -> int:
        """The row bucket of token bucket T."""
        return self.builder.rows_for(t_bucket)

    def compile_all(self, max_workers: int | None = None) -> float:
        """Compile the step for every shape. Returns the seconds taken.

        Tracing runs in this thread (it is Python); XLA compilations run in parallel
        threads (they release the GIL), `max_workers` at a time (default: CPU count).
        """
        start = time.perf_counter()
        shapes = self.buckets()
        lowered = [self._lower(shape) for shape in shapes]
        workers = max_workers or min(len(shapes), os.cpu_count() or 1)
        progress = ProgressLog(logger, "compiling step shapes", len(shapes), "shapes")

        def compile_one(low: jax.stages.Lowered) -> jax.stages.Compiled:
            exe = low.compile()
            progress.advance()
            return exe

        with ThreadPoolExecutor(max_workers=workers) as pool:
            compiled = list(pool.map(compile_one, lowered))
        self._executables = dict(zip(shapes, compiled, strict=True))
        elapsed = time.perf_counter() - start
        logger.info("compiled %d step shapes in %.1f s", len(shapes), elapsed)
        return elapsed

    def _lower(self, shape: StepShape) -> jax.stages.Lowered:
        step = functools.partial(
            _step,
            graphdef=self.graphdef,
            params_def=self._params_def,
            layout=self.builder.layout(shape),
            block_size=self.block_size,
            num_steps=shape.num_steps,
            dp=self.dp,
            output_sharding=self._output_sharding,
        )
        jitted = jax.jit(step, donate_argnums=(1,))
        buffers = self.builder.empty(shape).buffers
        if self.mesh is not None:
            buffers = [
                jax.ShapeDtypeStruct((self.dp * b.size,), b.dtype, sharding=self._input_sharding)
                for b in buffers
            ]
        return jitted.lower(self._params, self.kv_cache, *buffers)

    # ----- expert placement (EPLB) --------------------------------------------------------

    def expert_weights(self) -> list[tuple[jax.Array, ...]]:
        """[M] MoE layers (`moe_layers` order), each (w_gate [S, H, I], w_up [S, H, I],
        w_down [S, I, H]): the slot-indexed expert weights the compiled steps read."""
        return [
            tuple(self._params[self._param_index[("layers", i, "mlp", w)]] for w in EXPERT_WEIGHTS)
            for i in self.moe_layers
        ]

    def physical_to_logical(self) -> np.ndarray:
        """[M, S] int32 on the host: the logical expert each slot of each MoE layer holds
        (the model's `physical_to_logical` placement tables).

        Raises:
            ValueError: the model has no placement tables (one device or no MoE).
        """
        keys = [("layers", i, "mlp", "physical_to_logical") for i in self.moe_layers]
        if not keys or keys[0] not in self._param_index:
            raise ValueError("physical_to_logical: the model has no expert placement tables")
        return np.stack([np.asarray(self._params[self._param_index[k]]) for k in keys])

    def set_expert_placement(
        self, weights: list[tuple[jax.Array, ...]], tables: list[dict[str, jax.Array]]
    ) -> None:
        """Swap new expert weights and placement tables into the arrays the compiled
        steps read (no recompile: the same shapes, dtypes and shardings). Call it only
        with no step in flight: the old weights are usually donated to the move.

        weights: [M] as `expert_weights`; tables: [M] dicts of `PLACEMENT_FIELDS` arrays
        (e.g. `dataclasses.asdict` of an `ExpertPlacement`), in `moe_layers` order.

        Raises:
            ValueError: a list of another length, or an array of another shape / dtype
                than the one it replaces (names it).
        """
        if len(weights) != len(self.moe_layers) or len(tables) != len(self.moe_layers):
            raise ValueError(
                f"set_expert_placement: expected {len(self.moe_layers)} MoE layers, got "
                f"{len(weights)} weights and {len(tables)} tables"
            )
        updates = {}
        for i, layer_weights, layer_tables in zip(self.moe_layers, weights, tables, strict=True):
            updates.update(
                {
                    ("layers", i, "mlp", w): a
                    for w, a in zip(EXPERT_WEIGHTS, layer_weights, strict=True)
                }
            )
            updates.update({("layers", i, "mlp", k): v for k, v in layer_tables.items()})
        for key, value in updates.items():
            old = self._params[self._param_index[key]]
            if value.shape != old.shape or value.dtype != old.dtype:
                raise ValueError(
                    f"set_expert_placement: {'.'.join(map(str, key))} is {value.dtype}"
                    f"{list(value.shape)}, expected {old.dtype}{list(old.shape)}"
                )
        for key, value in updates.items():
            self._params[self._param_index[key]] = value
        self.state = jax.tree.unflatten(self._params_def, self._params)

    # ----- one step ----------------------------------------------------------------------

    def prepare(self, sched: SchedulerOutput | DPSchedulerOutput) -> StepInputs | DPStepInputs:
        """Pack a scheduler decision into padded NumPy inputs. Input tokens that the
        last dispatched step is still sampling are left for `fill_pending`.

        With dp > 1 (a `DPSchedulerOutput`): each rank is packed as on one device, all
        to the busiest rank's shape, into a `DPStepInputs`.

        Raises:
            ValueError: the step fits no compiled shape (a scheduler bug).
        """
        start = time.perf_counter()
        if isinstance(sched, DPSchedulerOutput):
            shape = self.builder.common_shape(sched.ranks)
            x = DPStepInputs.of(
                [
                    self.builder.build(s, rows, shape)
                    for s, rows in zip(sched.ranks, self._last_rank_rows, strict=True)
                ]
            )
        else:
            x = self.builder.build(sched, self._last_rows)
        self.last_prepare_s = time.perf_counter() - start
        return x

    def fill_pending(
        self, x: StepInputs | DPStepInputs, samples: StepSamples | list[StepSamples]
    ) -> None:
        """Write the tokens of the previous step (`fetch`'s result) into x's inputs."""
        if isinstance(x, DPStepInputs):
            x.fill_pending([s.token_ids for s in samples])
        else:
            x.fill_pending(samples.token_ids)

    def dispatch(self, x: StepInputs, sched: SchedulerOutput) -> StepHandle:
        """Queue the step on the device and return at once (the KV cache is donated).

        Raises:
            RuntimeError: the shape was not compiled.
        """
        buffers = x.buffers
        if self.publish is not None:
            self.publish(buffers, x.shape)
        out = self.run_buffers(x.shape, buffers)
        if isinstance(sched, DPSchedulerOutput):
            self._last_rank_rows = [
                {r.seq: row for row, r in enumerate(s.requests)} for s in sched.ranks
            ]
        else:
            self._last_rows = {r.seq: row for row, r in enumerate(sched.requests)}
        return StepHandle(out, x)

    def run_buffers(self, shape: StepShape, buffers: tuple[np.ndarray, ...]) -> StepOutput:
        """Queue the executable of `shape` on packed host buffers (what `dispatch` runs;
        a multi-process follower calls it with the leader's buffers). The KV cache is
        donated and replaced.

        Raises:
            RuntimeError: the shape was not compiled.
        """
        executable = self._executables.get(shape)
        if executable is None:
            raise RuntimeError(f"step shape {shape} was not compiled; call compile_all()")
        if self.mesh is not None:
            buffers = self._place(buffers)
        out, self.kv_cache = executable(self._params, self.kv_cache, *buffers)
        return out

    def _place(self, buffers: tuple[np.ndarray, ...]) -> list[jax.Array]:
        """Host buffers onto the mesh, leading axis over dp. With several processes each
        puts only its own devices' shards (`jax.device_put` of a global host array
        would compile a transfer per shape on the first step)."""
        sharding = self._input_sharding
        if jax.process_count() == 1:
            return jax.device_put(tuple(buffers), sharding)
        return [
            jax.make_array_from_callback(b.shape, sharding, lambda index, b=b: b[index])
            for b in buffers
        ]

    def fetch(self, handle: StepHandle) -> StepSamples | list[StepSamples]:
        """Wait for a dispatched step and copy what the host needs of its outputs.

        Returns:
            StepSamples with row r for the step's r-th scheduled request; with dp > 1,
            one per rank (its rows are rank k's r-th requests).
        """
        out, x = handle.out, handle.inputs
        start = time.perf_counter()
        jax.block_until_ready(out.token_ids)  # the one wait for the device
        self.last_wait_s = time.perf_counter() - start
        if isinstance(x, DPStepInputs):
            samples, counts = self._fetch_ranks(out, x)
        else:
            samples, counts = _samples(out, x, jax.device_get if self.mesh is None else _to_host)
        if self.expert_load is not None:
            self.expert_load.record(counts)
        return samples

    def _fetch_ranks(
        self, out: StepOutput, x: DPStepInputs
    ) -> tuple[list[StepSamples], np.ndarray]:
        """Per-rank samples of a DP step (rank k: rows [k R, (k + 1) R), tokens
        [k T, (k + 1) T) of the prompt log-probs), and the step's expert counts."""
        full = _samples_arrays(out, any(r.logprob_rows for r in x.ranks), _to_host)
        t, r = x.shape.num_tokens, x.shape.num_rows
        result = []
        for k, rank in enumerate(x.ranks):
            rows = slice(k * r, (k + 1) * r)
            part = StepOutput(
                *(a[:, rows] if a is not None else None for a in full[:4]),
                *(a[k * t : (k + 1) * t] if a is not None else None for a in full[4:7]),
                expert_counts=full[7],
            )
            result.append(_samples(part, rank, lambda tree: tree)[0])
        return result, full[7]

    def execute(self, sched):
        """prepare + dispatch + fetch: one synchronous step (every input token known)."""
        return self.fetch(self.dispatch(self.prepare(sched), sched))


# The slot-indexed expert weights of a `MoeBlock`, in the order EPLB moves them.
EXPERT_WEIGHTS = ("w_gate", "w_up", "w_down")


def _leaf_index(state) -> dict[tuple, int]:
    """State path (e.g. ("layers", 3, "mlp", "w_gate")) -> index of its array in the
    flat parameter list (`jax.tree.flatten` order)."""
    index = {}
    flat, _ = jax.tree_util.tree_flatten_with_path(state)
    for i, (key_path, _) in enumerate(flat):
        path = tuple(k.key for k in key_path if isinstance(k, jax.tree_util.DictKey))
        index[path] = i
    return index


def _to_host(tree):
    """Replicated device arrays as NumPy, also when other processes hold some devices."""

    def one(a):
        if a is None:
            return None
        if a.is_fully_addressable:
            return np.asarray(jax.device_get(a))
        return np.asarray(a.addressable_data(0))

    return jax.tree.map(one, tree, is_leaf=lambda a: a is None)


def _samples_arrays(out: StepOutput, logprobs: bool, get) -> tuple:
    """(token_ids, logprobs, top ids, top logprobs, prompt logprobs, prompt top ids,
    prompt top logprobs, expert counts) on the host, in one transfer; None for what the
    step does not need."""
    wanted = (out.token_ids,)
    wanted += (out.logprobs, out.top_token_ids, out.top_logprobs) if logprobs else (None,) * 3
    prompt = out.prompt_logprobs.shape[0] > 0
    wanted += (
        (out.prompt_logprobs, out.prompt_top_ids, out.prompt_top_logprobs)
        if prompt
        else (None,) * 3
    )
    return get((*wanted, out.expert_counts))


def _samples(out: StepOutput, x: StepInputs, get) -> tuple[StepSamples, np.ndarray]:
    """(StepSamples, expert counts [M, S]) of a one-rank step's outputs (device arrays
    with get=jax.device_get, host arrays with get=identity). The counts come back in the
    same transfer as the tokens."""
    n = x.num_rows
    if x.logprob_rows:
        token_ids, logprobs, top_ids, top_lps, counts = get(
            (out.token_ids, out.logprobs, out.top_token_ids, out.top_logprobs, out.expert_counts)
        )
        samples = StepSamples(token_ids[:, :n], logprobs[:, :n], top_ids[:, :n], top_lps[:, :n])
    else:
        token_ids, counts = get((out.token_ids, out.expert_counts))
        samples = StepSamples(np.asarray(token_ids)[:, :n])
    if x.prompt_spans:
        samples.prompt_logprobs = _prompt_entries(
            x, *get((out.prompt_logprobs, out.prompt_top_ids, out.prompt_top_logprobs))
        )
    return samples, np.asarray(counts)


def _step(
    params: list[jax.Array],
    kv_cache: KVCache,
    ints: jax.Array,
    floats: jax.Array,
    *,
    graphdef,
    params_def,
    layout: PackedLayout,
    block_size: int,
    num_steps: int,
    dp: int = 1,
    output_sharding: jax.sharding.Sharding | None = None,
):
    """The jitted step: (flat params, KV cache, packed inputs) -> (StepOutput, KV cache).

    dp > 1: the buffers are dp ranks' packed inputs concatenated (DP attention).
    output_sharding: where the StepOutput goes (on a mesh: replicated, so every process
    can read every row).
    """
    model = nnx.merge(graphdef, jax.tree.unflatten(params_def, params))
    x = layout.unpack(ints, floats, dp)
    out, kv_cache = _forward(model, kv_cache, x, block_size, num_steps)
    if output_sharding is not None:
        out = jax.lax.with_sharding_constraint(out, output_sharding)
    return out, kv_cache


def _forward(model, kv_cache: KVCache, x: DeviceInputs, block_size: int, num_steps: int):
    if num_steps > 1:
        return _decode_steps(model, kv_cache, x, block_size, num_steps)
    hidden, kv_cache, counts = model.forward_with_expert_counts(
        x.tokens, x.positions, kv_cache, x.metadata
    )
    out = sampler_lib.sample(
        model.compute_logits(hidden[x.logits_indices]), x.sampling, sampler_lib.K_MAX
    )
    if x.prompt_next_ids.shape[0]:  # static: only the full variant (P == T)
        prompt = sampler_lib.compute_prompt_logprobs(
            model.compute_logits(hidden), x.prompt_next_ids, sampler_lib.K_MAX
        )
    else:
        prompt = _no_prompt_logprobs()
    return _step_output(out, prompt, counts, add_step_axis=True), kv_cache


def _decode_steps(model, kv_cache, x: DeviceInputs, block_size: int, num_steps: int):
    """`num_steps` decode steps in one call (T == R: token r is row r's only token).

    Each step feeds the tokens the previous one sampled at the next position; the slot
    of position p is block_tables[r, p // block_size] * block_size + p % block_size (the
    scheduler allocated the blocks up front). Padded rows (seq_len 0) write nowhere.
    Stop conditions are the host's: it discards tokens sampled past a stop.
    """
    md0 = x.metadata
    real = md0.seq_lens > 0
    rows = jnp.arange(md0.block_tables.shape[0])

    def body(carry, step):
        kv, tokens, positions, seq_lens, counts = carry
        slots = md0.block_tables[rows, positions // block_size] * block_size
        slots = jnp.where(real, slots + positions % block_size, PAD_SLOT)
        md = dataclasses.replace(md0, slot_mapping=slots, seq_lens=seq_lens)
        hidden, kv, step_counts = model.forward_with_expert_counts(tokens, positions, kv, md)
        sampling = dataclasses.replace(
            x.sampling, num_output_tokens=x.sampling.num_output_tokens + step
        )
        out = sampler_lib.sample(model.compute_logits(hidden), sampling, sampler_lib.K_MAX)
        next_seq_lens = jnp.where(real, seq_lens + 1, 0)
        carry = (kv, out.token_ids, positions + 1, next_seq_lens, counts + step_counts)
        return carry, out

    # The expert counts are summed in the carry: one [M, S] array, not one per step.
    moe = model.moe_layers()
    counts = jnp.zeros((len(moe), model.num_expert_slots) if moe else (0, 0), jnp.int32)
    carry = (kv_cache, x.tokens, x.positions, md0.seq_lens, counts)
    (kv_cache, *_, counts), outs = jax.lax.scan(body, carry, jnp.arange(num_steps, dtype=jnp.int32))
    return _step_output(outs, _no_prompt_logprobs(), counts, add_step_axis=False), kv_cache


def _no_prompt_logprobs() -> tuple[jax.Array, jax.Array, jax.Array]:
    k = sampler_lib.K_MAX
    return jnp.zeros(0), jnp.zeros((0, k)), jnp.zeros((0, k), jnp.int32)


def _step_output(
    out: sampler_lib.SamplerOutput, prompt, expert_counts: jax.Array, add_step_axis: bool
) -> StepOutput:
    lead = (lambda a: a[None]) if add_step_axis else (lambda a: a)
    prompt_logprobs, prompt_top_logprobs, prompt_top_ids = prompt
    return StepOutput(
        token_ids=lead(out.token_ids),
        logprobs=lead(out.logprobs),
        top_token_ids=lead(out.top_token_ids),
        top_logprobs=lead(out.top_logprobs),
        prompt_logprobs=prompt_logprobs,
        prompt_top_ids=prompt_top_ids,
        prompt_top_logprobs=prompt_top_logprobs,
        expert_counts=expert_counts,
    )


def _prompt_entries(
    x: StepInputs, logprobs: np.ndarray, top_ids: np.ndarray, top_lps: np.ndarray
) -> dict[int, tuple[int, list]]:
    """Per row (first prompt position, [[logprob, [[id, logprob], ...top k]], ...])."""
    entries = {}
    for span in x.prompt_spans:
        rows = []
        for t in range(span.flat_start, span.flat_start + span.count):
            ids, lps = top_ids[t, : span.k].tolist(), top_lps[t, : span.k].tolist()
            rows.append([float(logprobs[t]), [[i, lp] for i, lp in zip(ids, lps, strict=True)]])
        entries[span.row] = (span.first_position, rows)
    return entries
