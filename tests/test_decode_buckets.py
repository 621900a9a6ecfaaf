"""Row buckets of the multi-step decode call: batch 1 runs at R = 1, not padded to
MIN_DECODE_ROWS (InputBuilder, host only)."""

from __future__ import annotations

import numpy as np

from jaxserve.engine.request import Request
from jaxserve.engine.scheduler import ScheduledRequest, SchedulerOutput
from jaxserve.engine.step_inputs import MIN_DECODE_ROWS, InputBuilder, StepShape
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
