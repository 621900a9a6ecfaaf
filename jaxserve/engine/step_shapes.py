"""The static shapes of the engine's compiled steps (`StepShape`), and which one a
scheduler decision takes (`StepBuckets`): the bucket arithmetic, no arrays.

Shapes a request can choose never reach the compiler: every step is padded to a token
bucket T (powers of two up to max_num_batched_tokens). The request-row count is tied to
it, R = min(T, max_num_seqs): a step of n tokens has at most n rows, and a padded row
costs only one row of the sampler, so one row bucket per T is enough. Each T has two
variants: the plain step, and a "full" one for the rare steps that need more: the
sampler's penalty history (L = max_model_len) and the logits of every token, for prompt
log-probs. With multi-step decode on, one more call per row bucket runs several decode
steps in a `lax.scan`. `step_inputs.InputBuilder` packs a decision into its shape's
arrays; the model runner compiles one executable per shape.
"""

from __future__ import annotations

from typing import NamedTuple

from jaxserve.engine.scheduler_output import SchedulerOutput

# The smallest token bucket T.
MIN_TOKEN_BUCKET = 16

# Row buckets of the multi-step decode call: one request alone (R = 1), then powers of
# two from MIN_DECODE_ROWS. With the blockwise CPU attention and the sampler's greedy
# path, one request decodes ~2x faster at R = 1 than padded to R = 4, while R = 2 gains
# little over 4 (demo model, CPU: scripts/bench_decode_rows.py), so only batch 1 gets its
# own bucket. SINGLE_ROW_DECODE_BUCKET = False (read when an InputBuilder is made) drops it.
MIN_DECODE_ROWS = 4
SINGLE_ROW_DECODE_BUCKET = True

# On the CPU every decode batch runs more steps per multi-step call: (most rows or None
# for any, factor on num_decode_steps), first match. Not on accelerators, where async
# scheduling overlaps the host step with the device's.
# - Small batches: a call of few rows is mostly fixed cost (dispatch, packing, fetching:
#   about 1 ms a call on the demo model at batch 1, against about 0.2 ms of device work a
#   step) on the same two cores as the device work, with no async scheduling to hide it.
#   Measured on the demo model (LLM.generate, 64 tokens, interleaved, medians of 7; 2-core
#   CPU): batch 1 gave 1635 / 1860 / 2622 tok/s at 4 / 8 / 16 steps a call, batch 8 4829 /
#   6171 / 5756, batch 32 6728 / 6798 / 6815.
# - Every batch, when served: a call's outputs cost the serving stack (sidecar, frontend,
#   gRPC, and a client on the same machine) about 300 us of CPU per row, whatever the
#   steps, taken from the cores the device work runs on; on the random Qwen3-MoE a decode
#   step costs about as much per row, so at 4 steps a call serving cost the engine ~11%,
#   8 halves that. Measured (2-core CPU, random Qwen3-MoE, 64 tokens, interleaved,
#   medians of 5): scripts/bench_serve.py --serve-flags='--num-decode-steps 2' (4 steps)
#   against the default: served concurrency 16 / 64 / 256 1.03 / 1.04 / 1.04x for 8 steps,
#   frontend + sidecar + client CPU 99 / 76 / 78 -> 73 / 51 / 57 us/token; offline
#   (compare_hf.py --baseline-python) batch 16 / 32 / 128 1.09 / 0.99 / 1.02x (runs
#   spread 5-21%: neutral), the demo model 1.06 / 1.19 / 1.19x (3 repeats).
# The cost is a longer call: a request arriving meanwhile waits for it, tokens stream in
# bursts of the call's steps, and up to factor x num_decode_steps - 1 surplus steps past a
# request's end.
CPU_DECODE_STEP_FACTORS = ((1, 4), (None, 2))


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


class StepBuckets:
    """The step shapes of an engine, and the one a decision takes.

    Args:
        token_buckets: the token buckets T, ascending.
        max_num_seqs: most rows per step; R = min(T, max_num_seqs).
        max_model_len: history width L of a step with a penalized row.
        decode_steps: decode steps of the multi-step decode family (1: none).
        dp: dp ranks of every step (a row's rank is `row.seq.rank`); T and R are per rank.
        cpu_decode_factors: decode row buckets run more decode steps per call
            (CPU_DECODE_STEP_FACTORS; the engine sets it on the CPU).
    """

    def __init__(
        self,
        token_buckets: tuple[int, ...],
        max_num_seqs: int,
        max_model_len: int,
        decode_steps: int = 1,
        dp: int = 1,
        cpu_decode_factors: bool = False,
    ):
        self.dp = dp
        self.token_buckets = token_buckets
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.decode_steps = decode_steps
        single = (1,) if SINGLE_ROW_DECODE_BUCKET else ()
        self._decode_row_buckets = tuple(
            sorted(set(single + pow2_buckets(MIN_DECODE_ROWS, max_num_seqs)))
        )
        # The decode steps of each decode row bucket's call.
        self._decode_steps = {
            r: decode_steps * _cpu_decode_factor(r) if cpu_decode_factors else decode_steps
            for r in self._decode_row_buckets
        }

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

    def decode_steps_for_rows(self, n_rows: int) -> int:
        """The decode steps of the multi-step call that runs n_rows rows (of the busiest
        rank): its row bucket's, `decode_steps` unless `cpu_decode_factors`. Raises
        ValueError when n_rows exceeds the largest bucket."""
        return self._decode_steps[pick_bucket(self._decode_row_buckets, n_rows)]

    def shapes(self) -> list[StepShape]:
        """Every shape a step can take: per token bucket a plain step and one with the
        penalty history and prompt logits; plus, with multi-step decode, one decode call
        per decode row bucket (T = R)."""
        plain = [StepShape(t, self.rows_for(t)) for t in self.token_buckets]
        full = [StepShape(t, self.rows_for(t), self.max_model_len, t) for t in self.token_buckets]
        decode = []
        if self.decode_steps > 1:
            decode = [StepShape(r, r, num_steps=k) for r, k in self._decode_steps.items()]
        return plain + full + decode

    def shape_for(self, sched: SchedulerOutput, full: bool) -> StepShape:
        """The one shape of a decision over every rank: the bucket of the busiest rank's
        tokens (rows for multi-step decode), the full variant if `full`.

        Raises:
            ValueError: the decision fits no shape.
        """
        rows, tokens = [0] * self.dp, [0] * self.dp
        for r in sched.requests:
            rows[r.seq.rank] += 1
            tokens[r.seq.rank] += r.num_tokens
        n_rows = max(rows)
        if sched.num_steps > 1:
            # The smallest bucket that holds the rows and runs that many steps: the
            # scheduler chose the steps for the rows it had, and may have scheduled fewer.
            r = next(
                (r for r, k in self._decode_steps.items() if r >= n_rows and k == sched.num_steps),
                None,
            )
            if r is None or full:
                raise ValueError(
                    f"num_steps: no multi-step shape for {sched.num_steps} steps of {n_rows} rows"
                )
            return StepShape(r, r, num_steps=sched.num_steps)
        t = pick_bucket(self.token_buckets, max(tokens))
        r = self.rows_for(t)
        if n_rows > r:
            raise ValueError(f"{n_rows} rows exceed the {r} rows of bucket T={t}")
        return StepShape(t, r, self.max_model_len, t) if full else StepShape(t, r)


def _cpu_decode_factor(rows: int) -> int:
    """CPU_DECODE_STEP_FACTORS' factor for a decode row bucket of `rows` rows."""
    return next((f for most, f in CPU_DECODE_STEP_FACTORS if most is None or rows <= most), 1)


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
