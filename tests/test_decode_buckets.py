"""Row buckets of the multi-step decode call: batch 1 runs at R = 1, not padded to
MIN_DECODE_ROWS (InputBuilder, host only)."""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve.engine.request import Request
from jaxserve.engine.scheduler import ScheduledRequest, SchedulerOutput
from jaxserve.engine.step_inputs import InputBuilder
from jaxserve.engine.step_shapes import MIN_DECODE_ROWS, StepShape
from jaxserve.sampling_params import SamplingParams


def _builder(max_num_seqs: int) -> InputBuilder:
    return InputBuilder((16, 32), max_num_seqs, 64, 8, 100, decode_steps=4)


def _decode(num_rows: int) -> SchedulerOutput:
    reqs = []
    for i in range(num_rows):
        seq = Request(f"r{i}", [1, 2, 3, 4], 3, SamplingParams(), seed=0)  # 1 output
        seq.block_table = [i + 1]
        reqs.append(ScheduledRequest(seq, 3, 1, True))
    return SchedulerOutput(requests=reqs, num_steps=4)


def test_batch_one_gets_its_own_decode_bucket():
    builder = _builder(max_num_seqs=24)
    assert MIN_DECODE_ROWS == 4
    assert builder.decode_row_buckets == (1, 4, 8, 16, 24)
    assert StepShape(1, 1, num_steps=4) in builder.shapes()
    sizes = {n: builder.shape_for(_decode(n), full=False) for n in (1, 2, 4, 5)}
    assert sizes == {
        1: StepShape(1, 1, num_steps=4),
        2: StepShape(4, 4, num_steps=4),
        4: StepShape(4, 4, num_steps=4),
        5: StepShape(8, 8, num_steps=4),
    }
    x = builder.build(_decode(1), {})
    assert x.shape == StepShape(1, 1, num_steps=4)
    np.testing.assert_array_equal(x.inputs.metadata.seq_lens, [4])
    np.testing.assert_array_equal(x.inputs.metadata.slot_mapping, [8 + 3])


def test_one_seq_engine_has_one_decode_bucket():
    assert _builder(max_num_seqs=1).decode_row_buckets == (1,)


def test_cpu_decode_buckets_run_their_factor_of_steps():
    """cpu_decode_factors (the CPU's): each decode row bucket's call runs num_decode_steps
    times its CPU_DECODE_STEP_FACTORS factor; a decision picks the smallest bucket that
    holds its rows and runs its steps, and a count no bucket runs is refused."""
    from jaxserve.engine.step_shapes import CPU_DECODE_STEP_FACTORS

    builder = InputBuilder((16, 32), 24, 64, 8, 100, decode_steps=4, cpu_decode_factors=True)

    def factor(rows: int) -> int:  # the table read directly, first match
        return next((f for most, f in CPU_DECODE_STEP_FACTORS if most is None or rows <= most), 1)

    want = {r: 4 * factor(r) for r in builder.decode_row_buckets}
    assert want[1] > want[24] > 4  # the table scales batch 1 most, and the largest too
    assert {s.num_rows: s.num_steps for s in builder.shapes() if s.num_steps > 1} == want
    for n in range(1, 25):
        bucket = min(r for r in builder.decode_row_buckets if r >= n)
        assert builder.decode_steps_for_rows(n) == want[bucket]

    def decode(n_rows: int, steps: int) -> SchedulerOutput:
        out = _decode(n_rows)
        out.num_steps = steps
        return out

    # 1 row with the 4-row bucket's steps (the scheduler chose them for more rows, then
    # scheduled fewer): the 4-row call, not the 1-row one.
    assert builder.shape_for(decode(1, want[4]), full=False) == StepShape(4, 4, num_steps=want[4])
    assert builder.shape_for(decode(1, want[1]), full=False) == StepShape(1, 1, num_steps=want[1])
    with pytest.raises(ValueError, match="num_steps"):
        builder.shape_for(decode(5, want[1]), full=False)  # no bucket of >= 5 rows runs it
    # Unscaled (accelerators): one count for every bucket.
    plain = _builder(max_num_seqs=24)
    assert {s.num_steps for s in plain.shapes() if s.num_steps > 1} == {4}
    assert plain.decode_steps_for_rows(1) == 4
