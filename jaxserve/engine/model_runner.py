"""`ModelRunner`: lowers the step function for every shape, dispatches steps, fetches results.

Owns the device side of the engine: the model's parameters, the paged KV cache and the
executables of `step_fn.step`, one per `StepShape`, compiled by its `StepCompiler`
(`step_compiler`). It packs a scheduler decision into padded host buffers
(`step_inputs.InputBuilder`), queues the executable on them, and copies back what the
host needs.

Shapes a request can choose never reach the compiler: every step is padded to a bucketed
`StepShape` (`step_shapes`: token buckets, row buckets, the full and multi-step decode
variants). The KV cache is donated to each call, so XLA updates it in place.

Calls are asynchronous: `dispatch` returns as soon as the step is queued (JAX's async
dispatch), and `fetch` waits for its tokens, so the engine can schedule the next step
meanwhile. The runner keeps no record of steps in flight: the engine core passes the
step whose tokens are still being sampled to `prepare`.

Every step also returns the expert load of its MoE layers (tokens routed to each expert
slot, padding excluded); `fetch` copies it with the sampled tokens, in the same transfer,
into `expert_load` (an `eplb.recorder.ExpertLoadRecorder`), for EPLB and the metrics.
EPLB re-places experts between steps through `expert_weights`, `physical_to_logical` and
`set_expert_placement`, which swap new arrays of the same shapes and shardings into the
parameter list the compiled steps take (no recompile), at the model contract's
`models.base.expert_param_path`.

Must not: schedule, know about requests beyond one step's decision, or talk to other
processes (the multi-process leader publishes the buffers before `dispatch`:
`jaxserve.distributed.executor`).
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.distributed.arrays import put_on_mesh, replicated_to_host
from jaxserve.engine.huge_pages import advise_huge_pages
from jaxserve.engine.outputs import StepSamples, step_samples
from jaxserve.engine.request import Request
from jaxserve.engine.scheduler_output import SchedulerOutput
from jaxserve.engine.step_compiler import StepCompiler
from jaxserve.engine.step_fn import StepOutput, step
from jaxserve.engine.step_inputs import InputBuilder, StepInputs
from jaxserve.engine.step_shapes import MIN_TOKEN_BUCKET, StepShape, pow2_buckets
from jaxserve.eplb.recorder import DEFAULT_WINDOW, ExpertLoadRecorder
from jaxserve.kernels import dispatch
from jaxserve.kernels.cpu_dense import pack_params
from jaxserve.kernels.cpu_moe import logical, pack_experts
from jaxserve.models.base import EXPERT_WEIGHTS, KVCache, KVLayout, expert_param_path
from jaxserve.models.config import ModelConfig
from jaxserve.models.moe_slices import MAX_EXPERT_BRANCHES, split_expert_params
from jaxserve.sharding.mesh import build_mesh
from jaxserve.sharding.rules import batch_sharding, kv_cache_sharding, replicated

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class InFlightStep:
    """A dispatched step: its scheduler decision, its packed inputs and its (possibly
    still running) device outputs. What the engine core's batch queue holds."""

    sched: SchedulerOutput
    inputs: StepInputs
    out: StepOutput


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
        mesh: the (dp, tp) mesh the model is on (default: one device, a 1 x 1 mesh). The KV cache
            holds dp ranks' pools of num_blocks // dp blocks each, and every step is the
            dp ranks' inputs concatenated (DP attention; see `prepare`).
        expert_load_window: steps of the expert-load window (`expert_load`).

    Raises:
        ValueError: num_blocks not divisible by the mesh's dp.

    Attributes:
        expert_load: the `ExpertLoadRecorder` every fetched step's expert counts go into
            (EP ranks = the mesh's devices), or None for a model without MoE layers.
        moe_layers: decoder-layer index of each row of the expert counts.
        last_wait_s / wait_time_s: seconds `fetch` blocked waiting for the device, in
            the last fetch / since start-up.
        compiler: the `StepCompiler` of the step shapes (`compile_all` compiles them all).
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
        if mesh is None:  # one device: a 1 x 1 mesh of this process's first device
            mesh = build_mesh(1, 1, jax.local_devices()[:1])
        self.mesh = mesh
        self.dp = mesh.shape["dp"]
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
            dp=self.dp,
            cpu_decode_factors=mesh.devices.flat[0].platform == "cpu",
        )
        self.max_blocks_per_seq = self.builder.max_blocks_per_seq
        self.moe_layers: tuple[int, ...] = model.moe_layers()
        self.expert_load: ExpertLoadRecorder | None = None
        if self.moe_layers:
            self.expert_load = ExpertLoadRecorder(
                len(self.moe_layers),
                model.num_expert_slots,
                ep=mesh.size,
                window=expert_load_window,
            )
        self.graphdef, self.state = nnx.split(model)
        # Steps take the parameters as a flat list: flattening the nested NNX state on
        # every call costs milliseconds of host time per step.
        self._params, self._params_def = jax.tree.flatten(self.state)
        self._param_index = _leaf_index(self.state)
        expert_paths = [expert_param_path(i, w) for i in self.moe_layers for w in EXPERT_WEIGHTS]
        if self._holds_experts_per_expert():
            self._params = split_expert_params(self._params, self._param_index, expert_paths)
        if mesh.size == 1 and hasattr(model, "dense_weights"):
            # One CPU device: projections panel-major for the CPU dense kernel (a no-op
            # elsewhere, or with JAXSERVE_CPU_DENSE_KERNEL=0).
            self._params = pack_params(self._params, self._param_index, model.dense_weights())
        if self._experts_stay_in_place():
            # No EPLB moves them (it re-places only stacked [S, H, I] arrays): the experts
            # panel-major for the CPU MoE kernel (a no-op with JAXSERVE_CPU_MOE_KERNEL=0,
            # without tiles, or where they are held per expert already).
            self._params = pack_experts(self._params, self._param_index, expert_paths)
        self.state = jax.tree.unflatten(self._params_def, self._params)
        # The model declares what its cache holds per token (per-head K/V, or an MLA latent).
        self.kv_layout: KVLayout = model.kv_layout()
        self.kv_bytes_per_token = self.kv_layout.bytes_per_token(
            model_config.num_hidden_layers, kv_dtype
        )
        self.kv_cache: KVCache = self.kv_layout.allocate(
            model_config.num_hidden_layers,
            num_blocks,
            block_size,
            kv_dtype,
            sharding=kv_cache_sharding(mesh, self.kv_layout.shard_heads),
        )
        # Where step inputs go (leading axis over dp) and outputs come back (replicated).
        self._input_sharding = batch_sharding(mesh, 1)
        self._output_sharding = replicated(mesh)
        self._param_specs = [jax.tree.map(_spec, p) for p in self._params]
        self._kv_specs = jax.tree.map(_spec, self.kv_cache)
        advise_huge_pages([*jax.tree.leaves(self._params), *jax.tree.leaves(self.kv_cache)])
        self.last_wait_s = 0.0
        self.wait_time_s = 0.0
        self.compiler = StepCompiler(self._lower)

    def _experts_stay_in_place(self) -> bool:
        """Whether the model has MoE layers on one device without placement tables: no
        expert parallelism and no EPLB move its expert weights, so the engine may hold
        them in another form (`moe_slices`, `cpu_moe.ExpertPanels`)."""
        return (
            bool(self.moe_layers)
            and self.mesh.size == 1
            and expert_param_path(self.moe_layers[0], "physical_to_logical")
            not in self._param_index
        )

    def _holds_experts_per_expert(self) -> bool:
        """Whether the expert weights are held one array per expert (`moe_slices`): asked
        for (`JAXSERVE_MOE_EXPERTS=sliced`), on the reference backend, on one device (no
        placement tables: no expert parallelism), and for at most `MAX_EXPERT_BRANCHES`
        experts over all MoE layers (compile time)."""
        if not self._experts_stay_in_place():
            return False
        w_gate = self._params[self._param_index[expert_param_path(self.moe_layers[0], "w_gate")]]
        return (
            dispatch.get_backend() == dispatch.REFERENCE
            and dispatch.moe_reference_experts() == dispatch.MOE_SLICED
            and w_gate.shape[0] * len(self.moe_layers) <= MAX_EXPERT_BRANCHES
        )

    # ----- compilation -------------------------------------------------------------------

    def buckets(self) -> list[StepShape]:
        """Every step shape start-up compiles (see `InputBuilder.shapes`)."""
        return self.builder.shapes()

    def rows_for(self, t_bucket: int) -> int:
        """The row bucket of token bucket T."""
        return self.builder.rows_for(t_bucket)

    def compile_all(self, max_workers: int | None = None) -> float:
        """Compile the step for every shape (`buckets()`). Returns the seconds taken."""
        elapsed = self.compiler.compile_shapes(self.buckets(), max_workers)
        logger.info("compiled %d step shapes in %.1f s", len(self.buckets()), elapsed)
        return elapsed

    def _lower(self, shape: StepShape) -> jax.stages.Lowered:
        fn = functools.partial(
            step,
            graphdef=self.graphdef,
            params_def=self._params_def,
            layout=self.builder.layout(shape),
            block_size=self.block_size,
            num_steps=shape.num_steps,
            dp=self.dp,
            output_sharding=self._output_sharding,
        )
        jitted = jax.jit(fn, donate_argnums=(1,))
        buffers = [
            jax.ShapeDtypeStruct(b.shape, b.dtype, sharding=self._input_sharding)
            for b in self.builder.empty(shape).buffers
        ]
        # Abstract arguments: a background compilation traces while steps donate (delete)
        # the KV cache and EPLB swaps parameters of the same shapes.
        return jitted.lower(self._param_specs, self._kv_specs, *buffers)

    # ----- expert placement (EPLB) --------------------------------------------------------

    def expert_weights(self) -> list[tuple[jax.Array, ...]]:
        """[M] MoE layers (`moe_layers` order), each (w_gate [S, H, I], w_up [S, H, I],
        w_down [S, I, H]): the slot-indexed expert weights the compiled steps read (their
        `moe_slices.ExpertSlices` where held per expert: one device, no EPLB); weights
        held panel-major for the CPU kernel (one device, no EPLB) come unpacked, a copy."""
        return [
            tuple(
                logical(self._params[self._param_index[expert_param_path(i, w)]])
                for w in EXPERT_WEIGHTS
            )
            for i in self.moe_layers
        ]

    def physical_to_logical(self) -> np.ndarray:
        """[M, S] int32 on the host: the logical expert each slot of each MoE layer holds
        (the model's `physical_to_logical` placement tables).

        Raises:
            ValueError: the model has no placement tables (one device or no MoE).
        """
        keys = [expert_param_path(i, "physical_to_logical") for i in self.moe_layers]
        if not keys or keys[0] not in self._param_index:
            raise ValueError("physical_to_logical: the model has no expert placement tables")
        # replicated_to_host: with several processes the tables span non-addressable devices.
        tables = [self._params[self._param_index[k]] for k in keys]
        return np.stack(replicated_to_host(tables))

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
                    expert_param_path(i, w): a
                    for w, a in zip(EXPERT_WEIGHTS, layer_weights, strict=True)
                }
            )
            updates.update({expert_param_path(i, k): v for k, v in layer_tables.items()})
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
        advise_huge_pages(updates.values())

    # ----- one step ----------------------------------------------------------------------

    def prepare(
        self, sched: SchedulerOutput, in_flight: SchedulerOutput | None = None
    ) -> StepInputs:
        """Pack a scheduler decision into padded NumPy inputs: each dp rank's rows as on
        one device, all to the busiest rank's shape (`InputBuilder.build`).

        in_flight: the dispatched step whose sampled tokens are not fetched yet (async
            scheduling), or None. Input tokens it is still sampling are left for
            `fill_pending`, which writes them in once `fetch` returned them.

        Raises:
            ValueError: the step fits no compiled shape (a scheduler bug).
        """
        return self.builder.build(sched, _rows(in_flight) if in_flight else {})

    def fill_pending(self, x: StepInputs, samples: StepSamples) -> None:
        """Write the tokens of the step in flight (`fetch`'s result) into x's inputs."""
        x.fill_pending(samples.token_ids)

    def dispatch(self, x: StepInputs, sched: SchedulerOutput) -> InFlightStep:
        """Queue the step of decision `sched` (packed as x) on the device and return at
        once (the KV cache is donated).

        Raises:
            RuntimeError: the shape was not compiled.
        """
        return InFlightStep(sched, x, self.run_buffers(x.shape, x.buffers))

    def run_once(self, shapes: list[StepShape]) -> float:
        """Run each of `shapes` (compiled) once on all-padding inputs, before any request;
        returns the seconds taken.

        An executable's first run on the CPU costs 11-29 ms more than its later ones (the
        one-time set-up of its fused kernels' runtimes; demo model, 2-core EPYC VM:
        scripts/bench_first_run.py, e.g. the 32-token prefill 18.3 vs 1.8 ms, the 8-row
        8-step decode 14.1 vs 2.6 ms, 408 ms for all 19 shapes), which the first request
        of each shape would otherwise wait for; vLLM's warm-up runs its captured shapes
        likewise. Padding writes nowhere (PAD_SLOT) and reads only the null block, so the
        KV cache keeps its contents; nothing is recorded (expert load, counters).

        Raises:
            RuntimeError: a shape was not compiled.
        """
        start = time.perf_counter()
        for shape in shapes:
            out = self.run_buffers(shape, self.builder.empty(shape).buffers)
            jax.block_until_ready(out.token_ids)
        return time.perf_counter() - start

    def run_buffers(self, shape: StepShape, buffers: tuple[np.ndarray, ...]) -> StepOutput:
        """Queue the executable of `shape` on packed host buffers (what `dispatch` runs;
        a multi-process follower calls it with the leader's buffers). The KV cache is
        donated and replaced.

        Raises:
            RuntimeError: the shape was not compiled.
        """
        executable = self.compiler.executable(shape)
        buffers = put_on_mesh(buffers, self._input_sharding)
        out, self.kv_cache = executable(self._params, self.kv_cache, *buffers)
        return out

    def fetch(self, step: InFlightStep) -> StepSamples:
        """Wait for a dispatched step and copy what the host needs of its outputs.

        Returns:
            StepSamples with row r for the step's r-th scheduled request (all ranks).
        """
        start = time.perf_counter()
        jax.block_until_ready(step.out.token_ids)  # the one wait for the device
        self.last_wait_s = time.perf_counter() - start
        self.wait_time_s += self.last_wait_s
        samples, counts = step_samples(step.out, step.inputs, replicated_to_host)
        if self.expert_load is not None:
            self.expert_load.record(counts)
        return samples


def _spec(a: jax.Array) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding)


def _rows(sched: SchedulerOutput) -> dict[Request, int]:
    """Row of each request of a step: where its sampled tokens are found."""
    return {r.seq: row for row, r in enumerate(sched.requests)}


def _leaf_index(state) -> dict[tuple, int]:
    """State path (e.g. ("layers", 3, "mlp", "w_gate")) -> index of its array in the
    flat parameter list (`jax.tree.flatten` order)."""
    index = {}
    flat, _ = jax.tree_util.tree_flatten_with_path(state)
    for i, (key_path, _) in enumerate(flat):
        path = tuple(k.key for k in key_path if isinstance(k, jax.tree_util.DictKey))
        index[path] = i
    return index
