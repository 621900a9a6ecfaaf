"""Host-side packing of one scheduler decision into the padded arrays of a device step.

Owns the flat-batch layout the model contract defines (models/base.py): the step's
tokens, positions and attention metadata, each row's logits index and sampling
metadata, and the positions whose logits give prompt log-probs, all padded to a
`StepShape`. It also records what the arrays cannot know yet: the input tokens that the
previous, still running step is sampling (`fill_pending` writes them in once they
arrive), and which outputs belong to which row. NumPy only: no device work here (the
model runner compiles and runs the step; the scheduler decides it).

Every step is the step of all dp ranks (one device is one rank): each rank's arrays are
packed as on one device (rank-local rows, slots and block ids) to one shape, and the
device takes the ranks' buffers concatenated (DP attention), so that a dp mesh axis
gives each rank its own share.

The ~20 arrays of a step (`packed_layout.DeviceInputs`) are views into two flat buffers
(int32 and float32, `packed_layout.PackedLayout`). A step starts from copies of its
shape's padding buffers (built once per shape) and writes each array once from Python
lists (`scripts/bench_pack_ab.py`: 1.6-2.1x faster packing than per-row NumPy writes at
batch 1-128, identical buffers).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from jaxserve.engine import sampling_metadata
from jaxserve.engine.packed_layout import DeviceInputs, PackedLayout
from jaxserve.engine.request import Request
from jaxserve.engine.scheduler_output import ScheduledRequest, SchedulerOutput
from jaxserve.engine.step_shapes import StepBuckets, StepShape
from jaxserve.models.base import PAD_SLOT, AttentionMetadata

__all__ = [
    "DeviceInputs",
    "InputBuilder",
    "PackedLayout",
    "PromptSpan",
    "StepInputs",
]


@dataclass(slots=True)
class PromptSpan:
    """Flat positions [flat_start, flat_start + count) of the step (all ranks) give the
    log-probs of prompt tokens first_position + 1 ... of `row` (its index in the step's
    rows, all ranks; top `k` alternatives each)."""

    row: int
    flat_start: int
    first_position: int
    count: int
    k: int


@dataclass(slots=True)
class StepInputs:
    """One packed step of every dp rank: the device arrays plus the host bookkeeping to
    finish and read it. Rows are the decision's rows, all ranks (`SchedulerOutput`).

    ranks: rank k's arrays, views into its share of `buffers` (rank-local rows, slots
        and block ids; its logits_indices index the step's flat batch, offset k * T).
    buffers: (int32 [dp * int_size], float32 [dp * float_size]): what the step takes.
    num_rows: real rows, all ranks.
    sample_rows: [num_rows] int64, the column of each row in the step's [S, dp * R]
        sampler outputs (rank k's j-th row: k * R + j).
    pending_tokens: (rank, flat index in the rank, previous-step row, decode step) of
        input tokens that the previous step is still sampling.
    pending_history: (rank, rank-local row, history column, previous-step row, decode
        step) likewise for the sampler's token history of penalized rows.
    logprob_rows: whether any row asked for sampled-token log-probs.
    row_errors: rows whose sampling parameters could not be packed (row -> message); they
        run as padding rows and the engine must end their requests with an error.
    """

    shape: StepShape
    ranks: list[DeviceInputs]
    buffers: tuple[np.ndarray, np.ndarray]
    num_rows: int = 0
    sample_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    pending_tokens: list[tuple[int, int, int, int]] = field(default_factory=list)
    pending_history: list[tuple[int, int, int, int, int]] = field(default_factory=list)
    prompt_spans: list[PromptSpan] = field(default_factory=list)
    logprob_rows: bool = False
    row_errors: dict[int, str] = field(default_factory=dict)

    @property
    def inputs(self) -> DeviceInputs:
        """Rank 0's arrays (with one rank: the step's)."""
        return self.ranks[0]

    def fill_pending(self, prev_token_ids: np.ndarray) -> None:
        """Write the previous step's sampled tokens ([S, R_prev] int32, its rows as in
        its `StepSamples`) into the inputs."""
        for k, t, prev_row, step in self.pending_tokens:
            self.ranks[k].tokens[t] = prev_token_ids[step, prev_row]
        for k, row, col, prev_row, step in self.pending_history:
            self.ranks[k].sampling.token_history[row, col] = prev_token_ids[step, prev_row]


class InputBuilder(StepBuckets):
    """Packs scheduler decisions into `StepInputs` of the shapes a `ModelRunner` compiles
    (its `StepBuckets`).

    Args:
        token_buckets, max_num_seqs, max_model_len, decode_steps, dp, cpu_decode_factors:
            as `StepBuckets`; max_model_len also sets the block-table width with
            block_size.
        block_size: tokens per KV block.
        vocab_size: V, for the sampler's metadata.
    """

    def __init__(
        self,
        token_buckets: tuple[int, ...],
        max_num_seqs: int,
        max_model_len: int,
        block_size: int,
        vocab_size: int,
        decode_steps: int = 1,
        dp: int = 1,
        cpu_decode_factors: bool = False,
    ):
        super().__init__(
            token_buckets, max_num_seqs, max_model_len, decode_steps, dp, cpu_decode_factors
        )
        self.block_size = block_size
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        self.vocab_size = vocab_size
        self._layouts: dict[StepShape, PackedLayout] = {}
        # All-padding buffers of one rank per shape (`empty` copies them).
        self._padding: dict[StepShape, tuple[np.ndarray, np.ndarray]] = {}

    # ----- packing -----------------------------------------------------------------------

    def needs_full(self, sched: SchedulerOutput) -> bool:
        """Whether a decision needs the full variant (penalty history, prompt logits)."""
        return any(
            sampling_metadata.uses_penalties(r.seq.params)
            or self._prompt_span(row, r.seq, r.start, r.num_tokens) is not None
            for row, r in enumerate(sched.requests)
        )

    def build(
        self,
        sched: SchedulerOutput,
        prev_rows: dict[Request, int],
        shape: StepShape | None = None,
    ) -> StepInputs:
        """Pack a decision (already committed by the scheduler) into padded arrays, each
        rank's rows into its share.

        Args:
            sched: the decision.
            prev_rows: row of each sequence in the previous step, for input tokens that
                step is still sampling (empty when every input token is known).
            shape: the shape to pad to; default the smallest that holds the decision.

        Raises:
            ValueError: the step fits no shape (a scheduler bug). A row whose sampling
                parameters the sampler cannot pack does not raise: it is packed as
                padding and listed in the result's `row_errors`.
        """
        reqs = sched.requests
        spans = [self._prompt_span(row, r.seq, r.start, r.num_tokens) for row, r in enumerate(reqs)]
        if shape is None:
            penalized = any(sampling_metadata.uses_penalties(r.seq.params) for r in reqs)
            wants_prompt = any(span is not None for span in spans)
            shape = self.shape_for(sched, penalized or wants_prompt)
        x = self.empty(shape)
        ranks: list[list[int]] = [[] for _ in range(self.dp)]
        for row, r in enumerate(reqs):
            ranks[r.seq.rank].append(row)
        x.sample_rows = np.empty(len(reqs), np.int64)
        for k, rows in enumerate(ranks):
            x.sample_rows[rows] = k * shape.num_rows + np.arange(len(rows))
            if rows:
                self._pack_rank(x, k, [reqs[row] for row in rows], rows, spans, prev_rows)
        x.num_rows = len(reqs)
        x.logprob_rows = any(r.seq.params.logprobs is not None for r in reqs)
        return x

    def _pack_rank(
        self,
        x: StepInputs,
        k: int,
        reqs: list[ScheduledRequest],
        rows: list[int],
        spans: list[PromptSpan | None],
        prev_rows: dict[Request, int],
    ) -> None:
        """Pack rank k's rows (reqs, step rows `rows`) into its arrays, as on one device."""
        inputs = x.ranks[k]
        md = inputs.metadata
        bs = self.block_size
        offset = k * x.shape.num_tokens  # of rank k's tokens in the step's flat batch
        # Python lists per row, then one NumPy write per array (a step of 128 decode
        # rows spent most of its packing time in per-row NumPy calls).
        tokens: list[int] = []
        positions: list[int] = []
        lens: list[int] = []
        starts: list[int] = []
        t = 0
        for j, r in enumerate(reqs):
            seq, n, table = r.seq, r.num_tokens, r.seq.block_table
            known = min(r.start + n, seq.num_tokens)
            if known > r.start:
                tokens += seq.token_ids[r.start : known]
            for p in range(max(known, r.start), r.start + n):
                x.pending_tokens.append((k, t + p - r.start, prev_rows[seq], p - seq.num_tokens))
                tokens.append(0)  # written by fill_pending
            positions += range(r.start, r.start + n)
            md.block_tables[j, : len(table)] = table
            lens.append(n)
            starts.append(r.start)
            span = spans[rows[j]]
            if span is not None:
                local = t + span.first_position - r.start
                next_ids = seq.prompt_token_ids[span.first_position + 1 :][: span.count]
                inputs.prompt_next_ids[local : local + span.count] = next_ids
                span.flat_start = offset + local
                x.prompt_spans.append(span)
            t += n
        num = len(reqs)
        lens_a = np.asarray(lens, np.int32)
        ends = np.cumsum(lens_a, dtype=np.int32)
        pos = np.asarray(positions, np.int32)
        token_req = np.repeat(np.arange(num, dtype=np.int32), lens_a)
        inputs.tokens[:t] = tokens
        inputs.positions[:t] = pos
        md.token_req[:t] = token_req
        md.slot_mapping[:t] = md.block_tables[token_req, pos // bs] * bs + pos % bs
        md.seq_lens[:num] = np.asarray(starts, np.int32) + lens_a
        md.query_start_loc[:num] = ends - lens_a
        inputs.logits_indices[:num] = offset + ends - 1
        md.query_start_loc[num:] = t
        self._fill_sampling(x, k, reqs, rows, prev_rows)

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
        self,
        x: StepInputs,
        k: int,
        reqs: list[ScheduledRequest],
        rows: list[int],
        prev_rows: dict[Request, int],
    ) -> None:
        """Rank k's sampling metadata (rows `rows` of the step: reqs)."""
        sampling_rows = [
            sampling_metadata.SamplingRow(
                r.seq.params, r.seq.prompt_token_ids, r.seq.output_token_ids, r.seq.seed
            )
            for r in reqs
        ]
        # One request's parameters must never fail the whole step (and with it every
        # other request): a row that cannot be packed is reported, not raised.
        errors: dict[int, str] = {}
        # Written straight into rank k's (padding-filled) buffers.
        sampling = sampling_metadata.prepare_sampling_metadata(
            sampling_rows,
            x.shape.num_rows,
            self.vocab_size,
            x.shape.history_len,
            errors,
            into=x.ranks[k].sampling,
        )
        x.row_errors.update({rows[j]: error for j, error in errors.items()})
        for j, r in enumerate(reqs):
            if j in errors:
                continue
            # Outputs still in flight (sampled by the previous step) come before this
            # step's tokens: they count for the RNG step and belong in the history.
            seq = r.seq
            prior = max(0, r.start + r.num_tokens - seq.num_tokens)
            sampling.num_output_tokens[j] += prior
            if prior and sampling_metadata.uses_penalties(seq.params):
                for i in range(prior):
                    x.pending_history.append((k, j, seq.num_tokens + i, prev_rows[seq], i))

    def empty(self, shape: StepShape) -> StepInputs:
        """All-padding inputs of `shape` for every rank (also what start-up compiles
        against)."""
        padding = self._padding.get(shape)
        if padding is None:
            template = self._padding_inputs(shape)
            padding = self._padding[shape] = self.layout(shape, template).pack(template)
        layout = self._layouts[shape]
        ints, floats = np.tile(padding[0], self.dp), np.tile(padding[1], self.dp)
        i, f = layout.int_size, layout.float_size
        ranks = [
            layout.views(ints[k * i : (k + 1) * i], floats[k * f : (k + 1) * f])
            for k in range(self.dp)
        ]
        for k in range(1, self.dp):
            ranks[k].logits_indices += k * shape.num_tokens
        return StepInputs(shape=shape, ranks=ranks, buffers=(ints, floats))

    def _padding_inputs(self, shape: StepShape) -> DeviceInputs:
        """One rank's all-padding arrays of `shape`."""
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
        return DeviceInputs(
            tokens=np.zeros(t_bucket, np.int32),
            positions=np.zeros(t_bucket, np.int32),
            metadata=metadata,
            logits_indices=np.zeros(r_bucket, np.int32),
            sampling=sampling_metadata.prepare_sampling_metadata(
                [], r_bucket, self.vocab_size, shape.history_len
            ),
            prompt_next_ids=np.full(shape.num_prompt_logits, -1, np.int32),
        )

    def layout(self, shape: StepShape, template: DeviceInputs | None = None) -> PackedLayout:
        """The packed layout of `shape`'s inputs (built once per shape)."""
        layout = self._layouts.get(shape)
        if layout is None:
            layout = PackedLayout.of(
                template if template is not None else self._padding_inputs(shape)
            )
            self._layouts[shape] = layout
        return layout
