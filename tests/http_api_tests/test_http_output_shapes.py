"""The OpenAI-compatible HTTP API's output shapes, without a server
(frontend/http/outputs.py): completion top log-probs hold the sampled token, and the
stream chunk fast path equals the generic chunks.
"""

from __future__ import annotations

import json

import pytest


def test_completion_top_logprobs_hold_the_sampled_token():
    # OpenAI's legacy completions and vLLM: a sampled token outside the N most likely is
    # added to its position's top_logprobs (N + 1 entries); chat keeps exactly N.
    from jaxserve.frontend.http.outputs import chat_logprobs, completion_logprobs
    from jaxserve.ipc import TextOutput

    texts = {1: "a", 2: "b", 3: "c"}.__getitem__
    out = TextOutput(
        "r", "ca", [3, 1], logprobs=[[-2.0, [[1, -0.5], [2, -1.0]]], [-0.5, [[1, -0.5], [2, -1.0]]]]
    )
    lp = completion_logprobs([out], texts, 0)
    assert lp["top_logprobs"] == [{"a": -0.5, "b": -1.0, "c": -2.0}, {"a": -0.5, "b": -1.0}]
    assert list(lp["top_logprobs"][0]) == ["a", "b", "c"]  # most likely first
    content = chat_logprobs([out], texts)["content"]
    assert [len(e["top_logprobs"]) for e in content] == [2, 2]


@pytest.mark.parametrize("chat", [False, True])
def test_fast_path_chunks_equal_the_generic_ones(chat):
    from jaxserve.frontend.http.outputs import ResponseWriter
    from jaxserve.ipc import TextOutput

    writer = ResponseWriter("id-1", 'demo "model"', chat=chat, logprobs=False, texts=None)
    cases = [
        [TextOutput("e", 'he said "hi"\n', [5])],
        [TextOutput("e", "ü", [6]), TextOutput("e", "€ \u2028", [7, 8])],
        [TextOutput("e", "", [9], finish_reason="stop", stop_reason="):")],
        [TextOutput("e", "x", [9], finish_reason="stop", stop_reason=17)],
        [TextOutput("e", "", [], finish_reason="length")],
    ]
    for outputs in cases:
        for include_usage in (False, True):
            text = "".join(o.text for o in outputs)
            want = writer._chunk(3, outputs, text, first=False)
            if include_usage:
                want["usage"] = None
            event = writer.event(3, outputs, first=False, include_usage=include_usage)
            assert event.startswith(b"data: ") and event.endswith(b"\n\n")
            assert json.loads(event[6:]) == want
