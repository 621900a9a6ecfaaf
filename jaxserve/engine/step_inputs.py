"""Host-side packing of one scheduler decision into the padded arrays of a device step.

Owns the flat-batch layout the model contract defines (models/base.py): the step's
tokens, positions and attention metadata, each row's logits index and sampling
metadata, and the positions whose logits give prompt log-probs, all padded to a
`StepShape`. It also records what the arrays cannot know yet: the input tokens that the
previous, still running step is sampling (`fill_pending` writes them in once they
arrive), and which outputs belong to which row. NumPy only: no device work here (the
model runner compiles and runs the step; the scheduler decides it).

The ~20 arrays of a step are views into two flat buffers (int32 and float32,
`PackedLayout`): a step moves two host buffers to the device instead of twenty small
ones, which is most of the host's dispatch cost; the step unpacks them by static slices.
A step starts from a copy of its shape's padding buffers (built once per shape) and
writes each array once from Python lists (`scripts/bench_pack_ab.py`: 1.8-2.4x faster
packing than per-row NumPy writes at batch 1-128, identical buffers).
"""

from __future__ import annotations

from collections.abc import Sequence as Sequence_
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import jax
import numpy as np

from jaxserve.engine import sampler as sampler_lib
from jaxserve.engine.request import Request
from jaxserve.engine.scheduler import SchedulerOutput
from jaxserve.models.base import PAD_SLOT, AttentionMetadata

# Row buckets of the multi-step decode call: one request alone (R = 1), then powers of
# two from MIN_DECODE_ROWS. With the blockwise CPU attention and the sampler's greedy
# path, one request decodes ~2x faster at R = 1 than padded to R = 4, while R = 2 gains
# little over 4 (demo model, CPU: scripts/bench_decode_rows.py), so only batch 1 gets its
# own bucket. SINGLE_ROW_DECODE_BUCKET = False (read when an InputBuilder is made) drops it.
MIN_DECODE_ROWS = 4
SINGLE_ROW_DECODE_BUCKET = True


class StepShape(NamedTuple):
    """The static shape of one compiled step (one executable per shape).

    num_tokens: T, tokens per forward pass.
    num_rows: R, request rows (logits rows sampled per decode step).
    history_len: L, width of the sampler's token history (0: no penalized row).
    num_prompt_logits: P, flat positions whose logits give prompt log-probs (0 or T).
    num_steps: decode steps per call (> 1: the multi-step decode family, T == R).
    """

    num_tokens: int
    num_rows: int
    history_len: int = 0
    num_prompt_logits: int = 0
    num_steps: int = 1


@jax.tree_util.register_dataclass
@dataclass
class DeviceInputs:
    """The arrays one step takes (NumPy on the host, jax.Array inside the step).

    tokens, positions: [T] int32; metadata: models/base.py's AttentionMetadata;
    logits_indices: [R] int32, flat index of each row's last token;
    sampling: the sampler's per-row metadata for R rows and history L;
    prompt_next_ids: [P] int32, at flat position t the prompt token that follows it when
        its prompt log-prob is wanted, else -1.
    """

    tokens: np.ndarray
    positions: np.ndarray
    metadata: AttentionMetadata
    logits_indices: np.ndarray
    sampling: sampler_lib.SamplingMetadata
    prompt_next_ids: np.ndarray


@dataclass(frozen=True, slots=True)
class PackedLayout:
    """Where each array of a `DeviceInputs` lives in two flat buffers, int32 and float32
    (uint32 arrays share the int32 buffer bit for bit).

    entries: per pytree leaf, (buffer: "i" or "f", shape, dtype, offset in elements).
    sizes: per pytree leaf, its number of elements.
    """

    treedef: Any
    entries: tuple[tuple[str, tuple[int, ...], np.dtype, int], ...]
    int_size: int
    float_size: int
    sizes: tuple[int, ...] = ()

    @classmethod
    def of(cls, template: DeviceInputs) -> PackedLayout:
        """The layout of `template`'s arrays (int32, uint32 or float32 each).

        Raises:
            TypeError: an array of another dtype.
        """
        leaves, treedef = jax.tree.flatten(template)
        entries, sizes = [], {"i": 0, "f": 0}
        for leaf in leaves:
            dtype = np.dtype(leaf.dtype)
            if dtype not in (np.int32, np.uint32, np.float32):
                raise TypeError(f"PackedLayout: {dtype} arrays are not packed")
            kind = "f" if dtype == np.float32 else "i"
            entries.append((kind, tuple(leaf.shape), dtype, sizes[kind]))
            sizes[kind] += leaf.size
        leaf_sizes = tuple(int(leaf.size) for leaf in leaves)
        return cls(treedef, tuple(entries), sizes["i"], sizes["f"], leaf_sizes)

    def pack(self, template: DeviceInputs) -> tuple[DeviceInputs, np.ndarray, np.ndarray]:
        """Copy `template` into fresh buffers; returns (views into them, ints, floats)."""
        ints = np.empty(self.int_size, np.int32)
        floats = np.empty(self.float_size, np.float32)
        views = []
        for leaf, (kind, shape, dtype, offset) in zip(
            jax.tree.leaves(template), self.entries, strict=True
        ):
            buf = ints if kind == "i" else floats
            view = buf[offset : offset + leaf.size].view(dtype).reshape(shape)
            view[...] = leaf
            views.append(view)
        return jax.tree.unflatten(self.treedef, views), ints, floats

    def views(self, ints: np.ndarray, floats: np.ndarray) -> DeviceInputs:
        """The arrays of a `DeviceInputs` as views into buffers of this layout (no copy)."""
        bufs = {"i": ints, "f": floats}
        views = []
        for (kind, shape, dtype, offset), size in zip(self.entries, self.sizes, strict=True):
            view = bufs[kind][offset : offset + size]
            if dtype != view.dtype:
                view = view.view(dtype)
            views.append(view.reshape(shape))
        return jax.tree.unflatten(self.treedef, views)

    def unpack(self, ints: jax.Array, floats: jax.Array, dp: int = 1) -> DeviceInputs:
        """The arrays back from the two buffers (traceable: static slices and bitcasts).

        With dp > 1 the buffers are dp ranks' buffers of this layout concatenated
        ([dp * int_size], [dp * float_size]); each array comes back as the ranks' arrays
        concatenated along its first axis (the DP flat-batch layout).
        """
        bufs = {"i": ints, "f": floats}
        if dp > 1:
            bufs = {k: b.reshape(dp, -1) for k, b in bufs.items()}
        leaves = []
        for kind, shape, dtype, offset in self.entries:
            size = int(np.prod(shape, dtype=np.int64))
            if dp > 1:
                flat = bufs[kind][:, offset : offset + size]
                shape = (dp * shape[0], *shape[1:])
            else:
                flat = bufs[kind][offset : offset + size]
            if flat.dtype != dtype:
                flat = jax.lax.bitcast_convert_type(flat, dtype)
            leaves.append(flat.reshape(shape))
        return jax.tree.unflatten(self.treedef, leaves)


@dataclass(slots=True)
class PromptSpan:
    """Flat positions [flat_start, flat_start + count) of `row` give the log-probs of
    prompt tokens first_position + 1 ... (top `k` alternatives each)."""

    row: int
    flat_start: int
    first_position: int
    count: int
    k: int


@dataclass(slots=True)
class StepInputs:
    """One packed step: the device arrays plus the host bookkeeping to finish and read it.

    pending_tokens: (flat index, previous-step row, previous-step decode step) of input
        tokens that the previous step is still sampling.
    pending_history: (row, history column, previous-step row, decode step) likewise for
        the sampler's token history of penalized rows.
    logprob_rows: whether any row asked for sampled-token log-probs.
    row_errors: rows whose sampling parameters could not be packed (row -> message); they
        run as padding rows and the engine must end their requests with an error.
    """

    shape: StepShape
    inputs: DeviceInputs  # views into `buffers`
    buffers: tuple[np.ndarray, np.ndarray]  # (int32, float32), what the step takes
    num_rows: int
    pending_tokens: list[tuple[int, int, int]] = field(default_factory=list)
    pending_history: list[tuple[int, int, int, int]] = field(default_factory=list)
    prompt_spans: list[PromptSpan] = field(default_factory=list)
    logprob_rows: bool = False
    row_errors: dict[int, str] = field(default_factory=dict)

    def fill_pending(self, prev_token_ids: np.ndarray) -> None:
        """Write the previous step's sampled tokens ([S, R_prev] int32) into the inputs."""
        for t, prev_row, step in self.pending_tokens:
            self.inputs.tokens[t] = prev_token_ids[step, prev_row]
        for row, col, prev_row, step in self.pending_history:
            self.inputs.sampling.token_history[row, col] = prev_token_ids[step, prev_row]


class InputBuilder:
    """Packs scheduler decisions into `StepInputs` of the shapes a `ModelRunner` compiles.

    Args:
        token_buckets: the token buckets T, ascending.
        max_num_seqs: most rows per step; R = min(T, max_num_seqs).
        max_model_len: history width L of a step with a penalized row; sets the
            block-table width with block_size.
        block_size: tokens per KV block.
        vocab_size: V, for the sampler's metadata.
        decode_steps: decode steps of the multi-step decode family (1: none).
    """

    def __init__(
        self,
        token_buckets: tuple[int, ...],
        max_num_seqs: int,
        max_model_len: int,
        block_size: int,
        vocab_size: int,
        decode_steps: int = 1,
    ):
        self.token_buckets = token_buckets
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        self.vocab_size = vocab_size
        self.decode_steps = decode_steps
        single = (1,) if SINGLE_ROW_DECODE_BUCKET else ()
        self._decode_row_buckets = tuple(
            sorted(set(single + pow2_buckets(MIN_DECODE_ROWS, max_num_seqs)))
        )
        self._layouts: dict[StepShape, PackedLayout] = {}
        self._blanks: dict[StepShape, tuple[np.ndarray, np.ndarray]] = {}

    # ----- shapes ------------------------------------------------------------------------

    def rows_for(self, t_bucket: int) -> int:
        """The row bucket of token bucket T: enough for any step of at most T tokens."""
        return min(t_bucket, self.max_num_seqs)

    @property
    def decode_row_buckets(self) -> tuple[int, ...]:
        """Row buckets of the multi-step decode call: 1, then powers of two from
        MIN_DECODE_ROWS to max_num_seqs (see SINGLE_ROW_DECODE_BUCKET). Below the
        smallest token bucket on purpose: a decode of a few rows runs ~2x faster at
        T = R = 4 than padded to T = 16 (demo shape, CPU)."""
        return self._decode_row_buckets

    def shapes(self) -> list[StepShape]:
        """Every shape a step can take: per token bucket a plain step and one with the
        penalty history and prompt logits; plus, with multi-step decode, one decode call
        per decode row bucket (T = R)."""
        plain = [StepShape(t, self.rows_for(t)) for t in self.token_buckets]
        full = [StepShape(t, self.rows_for(t), self.max_model_len, t) for t in self.token_buckets]
        decode = []
        if self.decode_steps > 1:
            k = self.decode_steps
            decode = [StepShape(r, r, num_steps=k) for r in self.decode_row_buckets]
        return plain + full + decode

    def shape_for(self, sched: SchedulerOutput, full: bool) -> StepShape:
        """The shape of a decision. Raises ValueError for one no shape holds."""
        n_rows = len(sched.requests)
        if sched.num_steps > 1:
            if sched.num_steps != self.decode_steps or full:
                raise ValueError(f"num_steps: no multi-step shape for {sched.num_steps} steps")
            r = pick_bucket(self.decode_row_buckets, n_rows)
            return StepShape(r, r, num_steps=sched.num_steps)
        t = pick_bucket(self.token_buckets, sched.num_tokens)
        r = self.rows_for(t)
        if n_rows > r:
            raise ValueError(f"{n_rows} rows exceed the {r} rows of bucket T={t}")
        return StepShape(t, r, self.max_model_len, t) if full else StepShape(t, r)

    # ----- packing -----------------------------------------------------------------------

    def needs_full(self, sched: SchedulerOutput) -> bool:
        """Whether a decision needs the full variant (penalty history, prompt logits)."""
        return any(
            sampler_lib.uses_penalties(r.seq.params)
            or self._prompt_span(row, r.seq, r.start, r.num_tokens) is not None
            for row, r in enumerate(sched.requests)
        )

    def common_shape(self, scheds: Sequence_[SchedulerOutput]) -> StepShape:
        """The one shape of a step made of several dp ranks' decisions: the bucket of
        the busiest rank's tokens (rows for multi-step decode), full if any rank needs it.

        Raises:
            ValueError: the ranks disagree on num_steps, or a rank fits no shape.
        """
        num_steps = {s.num_steps for s in scheds}
        if len(num_steps) != 1:
            raise ValueError(f"num_steps: dp ranks disagree ({sorted(num_steps)})")
        multi = scheds[0].num_steps > 1
        busiest = max(scheds, key=lambda s: len(s.requests) if multi else s.num_tokens)
        full = any(self.needs_full(s) for s in scheds)
        shape = self.shape_for(busiest, full)
        for s in scheds:
            if len(s.requests) > shape.num_rows:
                raise ValueError(f"{len(s.requests)} rows exceed the {shape.num_rows} of {shape}")
        return shape

    def build(
        self,
        sched: SchedulerOutput,
        prev_rows: dict[Request, int],
        shape: StepShape | None = None,
    ) -> StepInputs:
        """Pack a decision (already committed by the scheduler) into padded arrays.

        Args:
            sched: the decision.
            prev_rows: row of each sequence in the previous step, for input tokens that
                step is still sampling (empty when every input token is known).
            shape: the shape to pad to (a dp rank's share of a common step); default
                the smallest that holds the decision.

        Raises:
            ValueError: the step fits no shape (a scheduler bug). A row whose sampling
                parameters the sampler cannot pack does not raise: it is packed as
                padding and listed in the result's `row_errors`.
        """
        reqs = sched.requests
        spans = [self._prompt_span(row, r.seq, r.start, r.num_tokens) for row, r in enumerate(reqs)]
        if shape is None:
            penalized = any(sampler_lib.uses_penalties(r.seq.params) for r in reqs)
            wants_prompt = any(span is not None for span in spans)
            shape = self.shape_for(sched, penalized or wants_prompt)
        x = self.empty(shape)
        md = x.inputs.metadata
        bs = self.block_size
        # Python lists per row, then one NumPy write per array (a step of 128 decode
        # rows spent most of its packing time in per-row NumPy calls).
        tokens: list[int] = []
        positions: list[int] = []
        lens, starts = [], []
        t = 0
        for row, r in enumerate(reqs):
            seq, n, table = r.seq, r.num_tokens, r.seq.block_table
            known = min(r.start + n, seq.num_tokens)
            if known > r.start:
                tokens += seq.token_ids[r.start : known]
            for p in range(max(known, r.start), r.start + n):
                x.pending_tokens.append((t + p - r.start, prev_rows[seq], p - seq.num_tokens))
                tokens.append(0)  # written by fill_pending
            positions += range(r.start, r.start + n)
            md.block_tables[row, : len(table)] = table
            lens.append(n)
            starts.append(r.start)
            span = spans[row]
            if span is not None:
                span.flat_start = t + span.first_position - r.start
                next_ids = seq.prompt_token_ids[span.first_position + 1 :][: span.count]
                x.inputs.prompt_next_ids[span.flat_start : span.flat_start + span.count] = next_ids
                x.prompt_spans.append(span)
            t += n
        rows = len(reqs)
        if rows:
            lens_a = np.asarray(lens, np.int32)
            ends = np.cumsum(lens_a, dtype=np.int32)
            pos = np.asarray(positions, np.int32)
            token_req = np.repeat(np.arange(rows, dtype=np.int32), lens_a)
            x.inputs.tokens[:t] = tokens
            x.inputs.positions[:t] = pos
            md.token_req[:t] = token_req
            md.slot_mapping[:t] = md.block_tables[token_req, pos // bs] * bs + pos % bs
            md.seq_lens[:rows] = np.asarray(starts, np.int32) + lens_a
            md.query_start_loc[:rows] = ends - lens_a
            x.inputs.logits_indices[:rows] = ends - 1
        md.query_start_loc[rows:] = t
        self._fill_sampling(x, sched, prev_rows)
        x.num_rows = len(reqs)
        x.logprob_rows = any(r.seq.params.logprobs is not None for r in reqs)
        return x

    def _prompt_span(self, row: int, seq: Request, start: int, n: int) -> PromptSpan | None:
        """The prompt positions of chunk [start, start + n) whose log-probs seq still needs:
        position p predicts prompt token p + 1, so p < num_prompt_tokens - 1."""
        if seq.num_prompt_logprobs_missing <= 0:
            return None
        first = max(start, len(seq.prompt_logprobs))
        end = min(start + n, seq.num_prompt_tokens - 1)
        if first >= end:
            return None
        return PromptSpan(row, -1, first, end - first, seq.params.prompt_logprobs)

    def _fill_sampling(
        self, x: StepInputs, sched: SchedulerOutput, prev_rows: dict[Request, int]
    ) -> None:
        reqs = sched.requests
        rows = [
            sampler_lib.SamplingRow(
                r.seq.params, r.seq.prompt_token_ids, r.seq.output_token_ids, r.seq.seed
            )
            for r in reqs
        ]
        # One request's parameters must never fail the whole step (and with it every
        # other request): a row that cannot be packed is reported, not raised.
        # Written straight into the step's (padding-filled) buffers.
        sampling = sampler_lib.prepare_sampling_metadata(
            rows,
            x.shape.num_rows,
            self.vocab_size,
            x.shape.history_len,
            x.row_errors,
            into=x.inputs.sampling,
        )
        for row, r in enumerate(reqs):
            if row in x.row_errors:
                continue
            # Outputs still in flight (sampled by the previous step) come before this
            # step's tokens: they count for the RNG step and belong in the history.
            seq = r.seq
            prior = max(0, r.start + r.num_tokens - seq.num_tokens)
            sampling.num_output_tokens[row] += prior
            if prior and sampler_lib.uses_penalties(seq.params):
                for j in range(prior):
                    x.pending_history.append((row, seq.num_tokens + j, prev_rows[seq], j))

    def empty(self, shape: StepShape) -> StepInputs:
        """All-padding inputs of `shape` (also what start-up compiles against): fresh
        copies of the shape's padding buffers, built once."""
        blank = self._blanks.get(shape)
        if blank is None:
            blank = self._blanks[shape] = self._blank(shape)
        ints, floats = blank[0].copy(), blank[1].copy()
        views = self.layout(shape).views(ints, floats)
        return StepInputs(shape=shape, inputs=views, buffers=(ints, floats), num_rows=0)

    def _blank(self, shape: StepShape) -> tuple[np.ndarray, np.ndarray]:
        """The packed (int32, float32) buffers of an all-padding step of `shape`."""
        t_bucket, r_bucket = shape.num_tokens, shape.num_rows
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
        inputs = DeviceInputs(
            tokens=np.zeros(t_bucket, np.int32),
            positions=np.zeros(t_bucket, np.int32),
            metadata=metadata,
            logits_indices=np.zeros(r_bucket, np.int32),
            sampling=sampler_lib.prepare_sampling_metadata(
                [], r_bucket, self.vocab_size, shape.history_len
            ),
            prompt_next_ids=np.full(shape.num_prompt_logits, -1, np.int32),
        )
        layout = self._layouts.get(shape)
        if layout is None:
            layout = self._layouts[shape] = PackedLayout.of(inputs)
        _, ints, floats = layout.pack(inputs)
        return ints, floats

    def layout(self, shape: StepShape) -> PackedLayout:
        """The packed layout of `shape`'s inputs (built once per shape)."""
        if shape not in self._layouts:
            self.empty(shape)
        return self._layouts[shape]


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


def pick_bucket(buckets, n: int) -> int:
    """The smallest bucket >= n. Raises ValueError when n exceeds the largest."""
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


@dataclass(slots=True)
class DPStepInputs:
    """One step of dp ranks (DP attention): each rank's `StepInputs`, all of one shape,
    packed with rank-local rows, slots and block ids; the device takes their buffers
    concatenated (rank k's arrays at rows [k * R, (k + 1) * R) of every array).

    Each rank's logits_indices are already offset by k * T (they index the global flat
    batch); its prompt spans stay rank-local.
    """

    shape: StepShape
    ranks: list[StepInputs]

    @classmethod
    def of(cls, ranks: list[StepInputs]) -> DPStepInputs:
        shape = ranks[0].shape
        for k, x in enumerate(ranks):
            x.inputs.logits_indices += k * shape.num_tokens
        return cls(shape, ranks)

    @property
    def buffers(self) -> tuple[np.ndarray, np.ndarray]:
        """(int32 [dp * int_size], float32 [dp * float_size]): what the step takes."""
        return tuple(np.concatenate([x.buffers[i] for x in self.ranks]) for i in (0, 1))

    def fill_pending(self, prev: list[np.ndarray]) -> None:
        """Write each rank's previous-step tokens (prev[k]: [S, R_prev_k] int32) in."""
        for x, token_ids in zip(self.ranks, prev, strict=True):
            x.fill_pending(token_ids)
