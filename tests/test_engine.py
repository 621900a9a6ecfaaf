"""EngineCore and the offline LLM on a tiny random Qwen3-MoE, against independent references:
HF transformers' greedy `generate`, the same request run alone, and an unconstrained run.

One compiled engine serves every test (tests/conftest.py); tests leave it idle.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
from conftest import TINY_MAX_MODEL_LEN, swap_scheduler
from engine_helpers import assert_idle, greedy, hf_greedy, random_prompts, run_engine

from jaxserve.ipc import EngineRequest

pytestmark = pytest.mark.slow


# ----- issue 2: correctness of batching -----------------------------------------------------


def test_greedy_batch_equals_alone_and_hf(tiny_engine, hf_model):
    rng = random.Random(0)
    vocab = tiny_engine.model_config.vocab_size
    lengths = [1, 2, 3, 5, 7, 8, 9, 15, 16, 17, 31, 40, 57, 64, 65, 100]
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in lengths]
    before = tiny_engine.num_compilations
    batched = run_engine(tiny_engine, [(f"b{i}", p, greedy(16)) for i, p in enumerate(prompts)])
    for i, p in enumerate(prompts):
        alone = run_engine(tiny_engine, [(f"a{i}", p, greedy(16))])[f"a{i}"]
        assert batched[f"b{i}"].tokens == alone.tokens, f"prompt {i}: batch != alone"
        assert alone.tokens == hf_greedy(hf_model, p, 16), f"prompt {i}: engine != HF"
        assert alone.finish_reason == "length" and len(alone.tokens) == 16
    assert tiny_engine.num_compilations == before
    assert_idle(tiny_engine)


def test_seed_gives_same_tokens_alone_and_in_batch(tiny_engine):
    rng = random.Random(1)
    vocab = tiny_engine.model_config.vocab_size
    prompt = [rng.randrange(vocab) for _ in range(20)]
    seeded = dict(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=20)
    alone = run_engine(tiny_engine, [("alone", prompt, seeded)])["alone"].tokens
    others = [
        (f"o{i}", p, s)
        for i, (p, s) in enumerate(
            zip(
                random_prompts(rng, 7, 1, 60, vocab),
                [
                    dict(temperature=1.0, max_tokens=25),
                    dict(temperature=0.5, seed=7, max_tokens=10),
                    greedy(30),
                    dict(temperature=1.2, top_k=5, repetition_penalty=1.3, max_tokens=12),
                    dict(temperature=0.7, min_p=0.1, presence_penalty=0.5, max_tokens=18),
                    dict(temperature=1.0, logit_bias={3: 5.0}, logprobs=3, max_tokens=9),
                    dict(temperature=0.9, top_p=0.95, top_k=50, seed=99, max_tokens=20),
                ],
                strict=True,
            )
        )
    ]
    other_seed = dict(seeded, seed=99)
    batch = run_engine(
        tiny_engine, [("seeded", prompt, seeded), *others, ("other_seed", prompt, other_seed)]
    )
    assert batch["seeded"].tokens == alone
    # The same parameters with another seed give another text (the seed is used).
    assert batch["other_seed"].tokens != alone
    assert_idle(tiny_engine)


def test_no_compilation_after_warmup_random_workload(tiny_engine):
    rng = random.Random(2)
    vocab = tiny_engine.model_config.vocab_size
    before = tiny_engine.num_compilations

    def random_sampling() -> dict:
        s: dict = dict(max_tokens=rng.randint(1, 40))
        s["temperature"] = rng.choice([0.0, 0.0, 0.5, 1.0, 1.5])
        if rng.random() < 0.3:
            s["top_k"] = rng.randint(1, 100)
        if rng.random() < 0.3:
            s["top_p"] = rng.uniform(0.1, 1.0)
        if rng.random() < 0.2:
            s["min_p"] = rng.uniform(0.0, 0.3)
        if rng.random() < 0.2:
            s["repetition_penalty"] = rng.uniform(0.8, 1.5)
        if rng.random() < 0.2:
            s["frequency_penalty"] = rng.uniform(-1, 1)
        if rng.random() < 0.2:
            s["logit_bias"] = {rng.randrange(vocab): rng.uniform(-5, 5) for _ in range(3)}
        if rng.random() < 0.3:
            s["logprobs"] = rng.randint(0, 5)
        if rng.random() < 0.5:
            s["seed"] = rng.randrange(2**40)
        return s

    pending = [
        (f"w{i}", p, random_sampling())
        for i, p in enumerate(random_prompts(rng, 40, 1, TINY_MAX_MODEL_LEN - 10, vocab))
    ]
    finals: dict[str, int] = {}
    submitted: list[str] = []
    while pending or tiny_engine.has_work():
        for _ in range(rng.randint(0, 3)):  # requests arrive between steps
            if pending:
                rid, p, s = pending.pop()
                tiny_engine.add_request(EngineRequest(rid, np.asarray(p, np.int32), s))
                submitted.append(rid)
        if submitted and rng.random() < 0.05:
            tiny_engine.abort_requests([rng.choice(submitted)])
        for o in tiny_engine.step():
            if o.finish_reason is not None:
                finals[o.request_id] = finals.get(o.request_id, 0) + 1
                assert o.finish_reason in ("length", "abort"), (o.finish_reason, o.error)
    assert tiny_engine.num_compilations == before  # nothing compiled under the workload
    assert sorted(finals) == sorted(submitted) and set(finals.values()) == {1}
    assert_idle(tiny_engine)


# ----- limits and finishing -----------------------------------------------------------------


def test_max_tokens_eos_stop_token_ids_ignore_eos(tiny_engine):
    rng = random.Random(3)
    vocab = tiny_engine.model_config.vocab_size
    prompt = [rng.randrange(vocab) for _ in range(12)]
    ref = run_engine(tiny_engine, [("ref", prompt, greedy(24))])["ref"].tokens
    stop_id, eos_id = ref[3], ref[5]
    scheduler = tiny_engine.scheduler
    saved_eos = scheduler.eos_token_ids
    scheduler.eos_token_ids = frozenset({eos_id})  # as if the model declared this EOS
    try:
        r = run_engine(
            tiny_engine,
            [
                ("max", prompt, greedy(5, ignore_eos=True)),
                ("stop_id", prompt, greedy(24, stop_token_ids=[stop_id], ignore_eos=True)),
                ("eos", prompt, greedy(24)),
                ("ignore_eos", prompt, greedy(24, ignore_eos=True)),
            ],
        )
    finally:
        scheduler.eos_token_ids = saved_eos
    assert (r["max"].tokens, r["max"].finish_reason) == (ref[:5], "length")
    k = ref.index(stop_id)
    assert (r["stop_id"].tokens, r["stop_id"].finish_reason) == (ref[: k + 1], "stop")
    assert r["stop_id"].stop_reason == stop_id
    k = ref.index(eos_id)
    assert (r["eos"].tokens, r["eos"].finish_reason, r["eos"].stop_reason) == (
        ref[: k + 1],
        "stop",
        None,
    )
    assert (r["ignore_eos"].tokens, r["ignore_eos"].finish_reason) == (ref, "length")
    final = r["max"].outputs[-1]
    assert (final.num_prompt_tokens, final.num_output_tokens) == (12, 5)
    first = r["max"].outputs[0].first
    assert list(first["prompt_token_ids"]) == prompt and first["sampling"]["max_tokens"] == 5


def test_max_model_len_ends_with_length(tiny_engine):
    prompt = list(range(TINY_MAX_MODEL_LEN - 3))
    r = run_engine(tiny_engine, [("a", prompt, greedy(100))])["a"]
    assert (len(r.tokens), r.finish_reason) == (3, "length")


def test_abort_waiting_and_running_frees_blocks(tiny_engine):
    rng = random.Random(4)
    vocab = tiny_engine.model_config.vocab_size
    prompts = random_prompts(rng, 12, 5, 40, vocab)  # max_num_seqs 8: 4 wait
    for i, p in enumerate(prompts):
        tiny_engine.add_request(EngineRequest(f"r{i}", np.asarray(p, np.int32), greedy(60)))
    outs = []
    for _ in range(3):
        outs += tiny_engine.step()
    running = [s.request_id for s in tiny_engine.scheduler.running]
    waiting = [s.request_id for s in tiny_engine.scheduler.waiting]
    assert len(running) == 8 and len(waiting) == 4
    stats = tiny_engine.stats()
    assert stats.num_blocks_free < stats.num_blocks_total
    victims = running[:2] + waiting[:2]
    tiny_engine.abort_requests([*victims, "no-such-request"])
    tiny_engine.abort_requests(victims[:1])
    tiny_engine.abort_requests(running[2:] + waiting[2:])
    while tiny_engine.has_work():
        outs += tiny_engine.step()
    finals = [o for o in outs if o.finish_reason is not None]
    assert sorted(o.request_id for o in finals) == sorted(f"r{i}" for i in range(12))
    assert {o.finish_reason for o in finals} == {"abort"}
    assert_idle(tiny_engine)


def test_bad_requests_end_with_error_and_others_continue(tiny_engine):
    vocab = tiny_engine.model_config.vocab_size
    good = list(range(1, 20))
    ref = run_engine(tiny_engine, [("ref", good, greedy(10))])["ref"].tokens
    bad = {
        "empty": ([], greedy(4), "prompt_token_ids"),
        "vocab": ([1, vocab], greedy(4), "prompt_token_ids"),
        "too_long": (list(range(TINY_MAX_MODEL_LEN)), greedy(4), "prompt"),
        "temperature": ([1, 2], dict(temperature=-1.0), "temperature"),
        "top_p": ([1, 2], dict(top_p=0.0), "top_p"),
        "top_k": ([1, 2], dict(top_k=-2), "top_k"),
        "max_tokens": ([1, 2], dict(max_tokens=0), "max_tokens"),
        "stop_ids": ([1, 2], dict(stop_token_ids=[vocab + 5]), "stop_token_ids"),
        "n": ([1, 2], dict(n=2), "n"),
        "prompt_logprobs": ([1, 2], dict(prompt_logprobs=21), "prompt_logprobs"),
        "unknown_field": ([1, 2], dict(bogus=1), "sampling"),
    }
    r = run_engine(
        tiny_engine,
        [("good", good, greedy(10))] + [(k, p, s) for k, (p, s, _) in bad.items()],
    )
    assert r["good"].tokens == ref and r["good"].finish_reason == "length"
    for rid, (_, _, field) in bad.items():
        assert r[rid].finish_reason == "error", rid
        assert r[rid].error.startswith(field), (rid, r[rid].error)
        assert r[rid].outputs[0].first is not None
    assert_idle(tiny_engine)


def test_request_that_can_never_fit_gets_error(tiny_engine):
    with swap_scheduler(tiny_engine, num_blocks=5):  # 4 usable blocks = 32 tokens
        r = run_engine(tiny_engine, [("big", list(range(20)), greedy(30))])["big"]
    assert r.finish_reason == "error" and "KV blocks" in r.error


# ----- issue 3: prefix caching, chunked prefill, preemption --------------------------------


def test_prefix_cache_computes_only_suffix_and_matches_uncached(tiny_engine):
    rng = random.Random(5)
    vocab = tiny_engine.model_config.vocab_size
    bs = tiny_engine.block_manager.block_size
    prefix = [rng.randrange(vocab) for _ in range(3 * bs)]
    first, second = prefix + [1, 2, 3, 4, 5], prefix + [9, 8, 7, 6, 5, 4, 3]
    with swap_scheduler(tiny_engine, enable_prefix_caching=True) as sched:
        run_engine(tiny_engine, [("first", first, greedy(8))])
        before = sched.num_prefill_tokens_computed
        cached = run_engine(tiny_engine, [("second", second, greedy(8))])["second"]
        assert sched.num_prefill_tokens_computed - before == len(second) - 3 * bs
        assert sched.num_prefix_hits == 3 * bs
    with swap_scheduler(tiny_engine, enable_prefix_caching=False) as sched:
        uncached = run_engine(tiny_engine, [("second", second, greedy(8))])["second"]
        assert sched.num_prefill_tokens_computed == len(second)
    assert cached.tokens == uncached.tokens
    assert_idle(tiny_engine)


def test_chunked_prefill_keeps_decodes_going(tiny_engine, hf_model):
    rng = random.Random(6)
    vocab = tiny_engine.model_config.vocab_size
    short = random_prompts(rng, 3, 4, 10, vocab)
    long_prompt = [rng.randrange(vocab) for _ in range(150)]  # >= 8 chunks of 16
    with swap_scheduler(tiny_engine, max_num_batched_tokens=16) as sched:
        for i, p in enumerate(short):
            tiny_engine.add_request(EngineRequest(f"d{i}", np.asarray(p, np.int32), greedy(40)))
        warm = []
        while len(warm) < 3 * 2:  # every short request has its first two tokens
            warm += tiny_engine.step()
        tiny_engine.add_request(EngineRequest("long", np.asarray(long_prompt, np.int32), greedy(4)))
        long_seq = sched.requests["long"]
        prefill_steps = 0

        def on_step(outs):
            nonlocal prefill_steps
            if long_seq.num_output_tokens == 0:  # the long prompt is still being prefilled
                prefill_steps += 1
                got = {o.request_id: len(o.new_token_ids) for o in outs}
                # At least one: the step in flight when "long" came may be a multi-step decode.
                assert all(got.get(f"d{i}", 0) >= 1 for i in range(3)), got

        r = run_engine(tiny_engine, [], on_step=on_step)
    assert prefill_steps >= 8
    assert r["long"].tokens == hf_greedy(hf_model, long_prompt, 4)
    for i, p in enumerate(short):
        tokens = [t for o in warm if o.request_id == f"d{i}" for t in o.new_token_ids]
        assert tokens + r[f"d{i}"].tokens == hf_greedy(hf_model, p, 40)
    assert_idle(tiny_engine)


def test_preemption_with_tiny_pool_matches_unconstrained(tiny_engine):
    rng = random.Random(7)
    vocab = tiny_engine.model_config.vocab_size
    prompts = random_prompts(rng, 32, 5, 40, vocab)
    requests = [(f"p{i}", p, greedy(24)) for i, p in enumerate(prompts)]
    free = run_engine(tiny_engine, requests)
    with swap_scheduler(tiny_engine, num_blocks=17) as sched:  # 16 blocks = 128 tokens
        tight = run_engine(tiny_engine, requests)
        assert sched.num_preemptions > 0
        assert sched.bm.num_free_blocks == sched.bm.num_usable_blocks
    for rid, _, _ in requests:
        assert tight[rid].tokens == free[rid].tokens, rid
        assert tight[rid].finish_reason == "length"


# ----- the offline LLM API ------------------------------------------------------------------


@pytest.fixture(scope="module")
def llm(tiny_engine, tiny_moe_dir):
    from jaxserve.llm import LLM

    return LLM.from_engine(tiny_engine, tokenizer=tiny_moe_dir)


def test_llm_generate_matches_engine_and_decodes(llm, tiny_engine):
    from jaxserve import SamplingParams

    prompts = ["import os\n", "def add(a, b):", "hello"]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12))
    tok = llm.get_tokenizer()
    for prompt, out in zip(prompts, outs, strict=True):
        ids = tok.encode(prompt).ids
        ref = run_engine(tiny_engine, [("ref", ids, greedy(12))])["ref"]
        assert out.prompt == prompt and out.prompt_token_ids == ids
        assert out.token_ids == ref.tokens and out.finish_reason == "length"
        assert out.text == tok.decode(ref.tokens)


def test_llm_stop_string_and_n_samples(llm):
    from jaxserve import SamplingParams

    tok = llm.get_tokenizer()
    base = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0.0, max_tokens=30))[0]
    text = base.text
    stop = next(
        text[i : i + 2]
        for i in range(3, len(text) - 2)
        if text[i : i + 2].strip() and "\ufffd" not in text[i : i + 2]
    )
    cut = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0.0, max_tokens=30, stop=[stop]))
    out = cut[0].outputs[0]
    assert out.text == text[: text.index(stop)]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    assert (
        stop in tok.decode(out.token_ids) and out.token_ids == base.token_ids[: len(out.token_ids)]
    )

    params = SamplingParams(temperature=1.0, seed=42, max_tokens=10, n=3, logprobs=2)
    multi = llm.generate([[1, 2, 3]], params)[0]
    assert [o.index for o in multi.outputs] == [0, 1, 2]
    for j, o in enumerate(multi.outputs):
        alone = llm.generate(
            [[1, 2, 3]], SamplingParams(temperature=1.0, seed=42 + j, max_tokens=10)
        )[0]
        assert o.token_ids == alone.token_ids
        assert len(o.logprobs) == 10 and all(len(e[1]) == 2 for e in o.logprobs)
        assert o.cumulative_logprob == pytest.approx(sum(e[0] for e in o.logprobs))
    assert len({tuple(o.token_ids) for o in multi.outputs}) > 1


def test_llm_rejects_bad_input(llm):
    from jaxserve import SamplingParams

    with pytest.raises(ValueError, match="temperature"):
        llm.generate(["x"], SamplingParams(temperature=-1))
    with pytest.raises(ValueError, match="prompt"):
        llm.generate([list(range(TINY_MAX_MODEL_LEN))], SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(["a", "b"], [SamplingParams()])
    assert_idle(llm.engine)


# ----- the model runner's input packing -----------------------------------------------------


def test_runner_prepare_matches_reference_layout_and_buckets(tiny_engine):
    """`prepare` against the model engineer's independent metadata builder, over random
    mixed steps; every chosen bucket is one that start-up compiles."""
    from flax import nnx
    from model_utils import StepRequest, build_step

    from jaxserve.engine.model_runner import ModelRunner
    from jaxserve.engine.request import Request
    from jaxserve.engine.scheduler import ScheduledRequest, SchedulerOutput
    from jaxserve.sampling_params import SamplingParams

    src = tiny_engine.runner
    runner = ModelRunner(
        nnx.merge(src.graphdef, src.state),
        tiny_engine.model_config,
        num_blocks=512,
        block_size=8,
        max_model_len=TINY_MAX_MODEL_LEN,
        max_num_seqs=48,
        max_num_batched_tokens=200,
    )
    assert runner.token_buckets == (16, 32, 64, 128, 200)
    assert [runner.rows_for(t) for t in runner.token_buckets] == [16, 32, 48, 48, 48]
    compiled = set(runner.buckets())
    rng = random.Random(8)
    for _ in range(200):
        budget, reqs, free_blocks = rng.randint(1, 200), [], list(range(1, 512))
        rng.shuffle(free_blocks)
        while budget > 0 and len(reqs) < 48:
            start = rng.randint(0, 30)
            n = min(budget, rng.choice([1, 1, 1, rng.randint(1, 40)]))
            table = [free_blocks.pop() for _ in range(-(-(start + n) // 8))]
            prompt = [rng.randrange(100) for _ in range(start + n)]
            params = SamplingParams(repetition_penalty=1.2 if rng.random() < 0.05 else 1.0)
            seq = Request(f"s{len(reqs)}", prompt, len(prompt), params, seed=0)
            seq.block_table = table
            reqs.append(ScheduledRequest(seq, start, n, True))
            budget -= n
        x = runner.prepare(SchedulerOutput(requests=reqs))
        assert x.shape in compiled
        t_bucket, r_bucket = x.shape.num_tokens, x.shape.num_rows
        ref_tokens, ref_pos, ref_md = build_step(
            [StepRequest(r.seq.token_ids[r.start :], r.start, r.seq.block_table) for r in reqs],
            block_size=8,
            max_blocks=runner.max_blocks_per_seq,
            num_tokens=t_bucket,
            num_reqs=r_bucket,
        )
        num_real = sum(r.num_tokens for r in reqs)
        inputs = x.inputs
        np.testing.assert_array_equal(inputs.tokens, ref_tokens)
        np.testing.assert_array_equal(inputs.positions, ref_pos)
        for name in ("slot_mapping", "block_tables", "seq_lens", "query_start_loc"):
            np.testing.assert_array_equal(getattr(inputs.metadata, name), getattr(ref_md, name))
        np.testing.assert_array_equal(
            inputs.metadata.token_req[:num_real], np.asarray(ref_md.token_req)[:num_real]
        )
        ends = np.cumsum([r.num_tokens for r in reqs]) - 1
        np.testing.assert_array_equal(inputs.logits_indices[: len(reqs)], ends)


# ----- sampler limits: checked at the door, and no request can stop the engine --------------


def _too_many_biases() -> dict[int, float]:
    from jaxserve.sampling_params import MAX_LOGIT_BIAS

    return {t: 1.0 for t in range(MAX_LOGIT_BIAS + 1)}


def test_sampler_limits_end_with_error_and_others_continue(tiny_engine):
    """Parameters the sampler cannot hold (more logit_bias entries than its arrays,
    floats beyond float32) end their request with an error naming the field, while a
    seeded request beside them gives the tokens it gives alone."""
    normal = dict(temperature=0.8, seed=11, logit_bias={3: 2.0}, max_tokens=12)
    prompt = list(range(1, 20))
    alone = run_engine(tiny_engine, [("alone", prompt, normal)])["alone"].tokens
    bad = {
        "biases": dict(logit_bias=_too_many_biases()),
        "bias_1e308": dict(logit_bias={5: 1e308}),
        "temperature": dict(temperature=1e308),
        "repetition_penalty": dict(repetition_penalty=1e308),
    }
    fields = {"biases": "logit_bias", "bias_1e308": "logit_bias.5"}
    r = run_engine(
        tiny_engine,
        [("normal", prompt, normal)]
        + [(k, [1, 2, 3], dict(s, max_tokens=4)) for k, s in bad.items()],
    )
    assert r["normal"].tokens == alone and r["normal"].finish_reason == "length"
    for rid in bad:
        assert r[rid].finish_reason == "error", rid
        assert r[rid].error.startswith(f"{fields.get(rid, rid)}:"), (rid, r[rid].error)
    assert_idle(tiny_engine)


@pytest.mark.parametrize(
    "when, async_scheduling", [("waiting", True), ("running", True), ("running", False)]
)
def test_unpackable_row_ends_with_error_and_others_continue(tiny_engine, when, async_scheduling):
    """Defence in depth: a request whose parameters turn out unpackable only inside a
    step (here: changed after validation) ends with an error and frees its blocks; the
    step and every other request go on as if it had never been there."""
    normal = dict(temperature=0.8, seed=5, max_tokens=16)
    prompt = list(range(30, 50))
    spoiled = []

    def spoil(outputs=()):
        seq = tiny_engine.scheduler.requests.get("victim")
        if seq is None or spoiled or (when == "running" and seq.num_output_tokens == 0):
            return
        seq.params.logit_bias = _too_many_biases()
        spoiled.append(seq.num_output_tokens)

    with swap_scheduler(tiny_engine, async_scheduling=async_scheduling):
        alone = run_engine(tiny_engine, [("alone", prompt, normal)])["alone"].tokens
        tiny_engine.add_request(EngineRequest("normal", np.asarray(prompt, np.int32), normal))
        victim = EngineRequest("victim", np.arange(1, 9, dtype=np.int32), greedy(40))
        tiny_engine.add_request(victim)
        spoil()
        r = run_engine(tiny_engine, [], on_step=spoil)
        assert len(spoiled) == 1 and (spoiled[0] == 0) == (when == "waiting"), spoiled
        assert r["normal"].tokens == alone and r["normal"].finish_reason == "length"
        assert r["victim"].finish_reason == "error"
        assert r["victim"].error.startswith("logit_bias: at most"), r["victim"].error
        assert len(r["victim"].tokens) < 40
        assert_idle(tiny_engine)


def test_llm_rejects_sampler_limits_and_stays_usable(llm, tiny_engine):
    from jaxserve import SamplingParams

    ref = llm.generate([[4, 5, 6]], SamplingParams(temperature=0.0, max_tokens=8))[0].token_ids
    with pytest.raises(ValueError, match="^logit_bias: at most"):
        llm.generate("def ", SamplingParams(logit_bias=_too_many_biases()))
    with pytest.raises(ValueError, match=r"^logit_bias\.5:"):
        llm.generate("def ", SamplingParams(logit_bias={5: 1e308}))
    with pytest.raises(ValueError, match="^temperature:"):
        llm.generate("def ", SamplingParams(temperature=1e308))
    assert_idle(tiny_engine)
    again = llm.generate([[4, 5, 6]], SamplingParams(temperature=0.0, max_tokens=8))[0]
    assert again.token_ids == ref


def test_llm_is_usable_after_an_interrupted_generate(llm, tiny_engine, monkeypatch):
    """An exception in the middle of a step (here Ctrl-C while waiting for the device)
    aborts the call's requests: no leftover request, and the next call works."""
    from jaxserve import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=20)
    ref = llm.generate([[7, 8, 9], [1, 2]], params)
    fetch, calls = tiny_engine.runner.fetch, []

    def interrupted_fetch(handle):
        calls.append(handle)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return fetch(handle)

    monkeypatch.setattr(tiny_engine.runner, "fetch", interrupted_fetch)
    with pytest.raises(KeyboardInterrupt):
        llm.generate([[7, 8, 9], [1, 2]], params)
    monkeypatch.undo()
    assert_idle(tiny_engine)
    assert not tiny_engine.has_work()
    again = llm.generate([[7, 8, 9], [1, 2]], params)
    assert [o.token_ids for o in again] == [o.token_ids for o in ref]
