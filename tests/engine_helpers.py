"""Helpers of the engine tests: run requests through an EngineCore to completion, checking
that each ends with exactly one final output, and HF transformers' greedy reference."""

from __future__ import annotations

import random

import numpy as np

from jaxserve.ipc import EngineRequest


def hf_greedy(hf_model, prompt: list[int], max_new_tokens: int) -> list[int]:
    import torch

    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf_model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
        )
    return out[0, len(prompt) :].tolist()


def greedy(max_tokens: int, **kw) -> dict:
    return dict(temperature=0.0, max_tokens=max_tokens, **kw)


class Result:
    def __init__(self):
        self.tokens: list[int] = []
        self.outputs = []
        self.finish_reason = None
        self.stop_reason = None
        self.error = None


def run_engine(engine, requests, on_step=None, max_steps=5000) -> dict[str, Result]:
    """Submit (request_id, prompt, sampling) tuples together and step until idle.

    Asserts that each request ends with exactly one final output and nothing after it.
    """
    for rid, prompt, sampling in requests:
        engine.add_request(EngineRequest(rid, np.asarray(prompt, np.int32), sampling))
    results: dict[str, Result] = {}
    for _ in range(max_steps):
        if not engine.has_work():
            break
        outs = engine.step()
        if on_step:
            on_step(outs)
        for o in outs:
            r = results.setdefault(o.request_id, Result())
            assert r.finish_reason is None, f"{o.request_id}: output after its final one"
            r.tokens += o.new_token_ids
            r.outputs.append(o)
            r.finish_reason, r.stop_reason, r.error = o.finish_reason, o.stop_reason, o.error
    else:
        raise AssertionError("engine did not drain")
    for rid, _, _ in requests:
        assert results[rid].finish_reason is not None, rid
    return results


def random_prompts(rng: random.Random, n: int, lo: int, hi: int, vocab: int) -> list[list[int]]:
    return [[rng.randrange(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def assert_idle(engine):
    stats = engine.stats()
    assert stats.num_running == stats.num_waiting == 0
    assert stats.num_blocks_free == stats.num_blocks_total
