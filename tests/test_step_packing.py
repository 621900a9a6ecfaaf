"""InputBuilder.build packs a mixed step (a prefill chunk, decodes, a token still being
sampled) into the arrays the model contract defines; each step gets its own copy of the
padding buffers (host only)."""

from __future__ import annotations

import numpy as np

from jaxserve.engine.request import Request
from jaxserve.engine.scheduler import ScheduledRequest, SchedulerOutput
from jaxserve.engine.step_inputs import InputBuilder
from jaxserve.models.base import PAD_SLOT
from jaxserve.sampling_params import SamplingParams

BS = 4  # tokens per block


def _builder() -> InputBuilder:
    return InputBuilder((16, 32), 8, 64, BS, 100)


def _step():
    """Row 0: a prefill chunk [2, 9) of a 12-token prompt; row 1: a decode whose input
    token is known; row 2: a decode whose input token the previous step still samples."""
    a = Request("a", list(range(10, 22)), 12, SamplingParams(temperature=0.0), seed=1)
    a.block_table = [5, 6, 7]
    b = Request("b", [1, 2, 3, 4, 5, 6], 5, SamplingParams(temperature=0.5), seed=2)
    b.block_table = [3, 9]
    c = Request("c", [7, 8, 9], 3, SamplingParams(temperature=0.0), seed=3)  # token 3 is in flight
    c.block_table = [4]
    reqs = [ScheduledRequest(a, 2, 7, False), ScheduledRequest(b, 5, 1, True),
            ScheduledRequest(c, 3, 1, True)]  # fmt: skip
    return SchedulerOutput(requests=reqs), {c: 6}


def test_mixed_step_matches_per_row_reference():
    sched, prev_rows = _step()
    x = _builder().build(sched, prev_rows)
    md = x.inputs.metadata
    # Reference, row by row in plain Python.
    tokens, positions, slots, owner = [], [], [], []
    for row, r in enumerate(sched.requests):
        for p in range(r.start, r.start + r.num_tokens):
            tokens.append(r.seq.token_ids[p] if p < r.seq.num_tokens else 0)
            positions.append(p)
            slots.append(r.seq.block_table[p // BS] * BS + p % BS)
            owner.append(row)
    t = len(tokens)
    assert x.shape.num_tokens == 16 and t == 9
    np.testing.assert_array_equal(x.inputs.tokens[:t], tokens)
    np.testing.assert_array_equal(x.inputs.positions[:t], positions)
    np.testing.assert_array_equal(md.slot_mapping[:t], slots)
    np.testing.assert_array_equal(md.slot_mapping[t:], PAD_SLOT)
    np.testing.assert_array_equal(md.token_req[:t], owner)
    np.testing.assert_array_equal(md.seq_lens[:4], [9, 6, 4, 0])
    np.testing.assert_array_equal(md.query_start_loc[:5], [0, 7, 8, 9, 9])
    np.testing.assert_array_equal(x.inputs.logits_indices[:3], [6, 7, 8])
    np.testing.assert_array_equal(md.block_tables[0, :4], [5, 6, 7, 0])
    np.testing.assert_array_equal(md.block_tables[1, :3], [3, 9, 0])
    assert x.pending_tokens == [(0, 8, 6, 0)]  # rank 0, flat index 8 <- previous row 6, step 0
    np.testing.assert_allclose(x.inputs.sampling.temperature[:3], [0.0, 0.5, 0.0])
    x.fill_pending(np.array([[0, 0, 0, 0, 0, 0, 77]], np.int32))
    assert x.inputs.tokens[8] == 77


def test_each_step_gets_fresh_padding():
    builder = _builder()
    sched, prev_rows = _step()
    first = builder.build(sched, prev_rows)
    for buf in first.buffers:
        buf[...] = 123  # a step's buffers are its own: scribbling on them leaks nowhere
    empty = builder.empty(first.shape)
    md = empty.inputs.metadata
    np.testing.assert_array_equal(md.slot_mapping, PAD_SLOT)
    np.testing.assert_array_equal(md.seq_lens, 0)
    np.testing.assert_array_equal(empty.inputs.sampling.top_p, 1.0)
    np.testing.assert_array_equal(empty.inputs.sampling.logit_bias_ids, -1)
    again = builder.build(sched, prev_rows)
    np.testing.assert_array_equal(again.inputs.metadata.seq_lens[:4], [9, 6, 4, 0])
    np.testing.assert_array_equal(again.inputs.metadata.token_req[9:], 7)
