"""The on-device sampler against the NumPy reference sampler (tests/sampler_reference.py).

Fixed random logits; every expectation is computed independently in float64 NumPy.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats

from jaxserve.engine import sampler, sampling_metadata
from jaxserve.engine.sampling_metadata import SamplingRow, prepare_sampling_metadata
from jaxserve.sampling_params import FLOAT32_MAX, MAX_LOGIT_BIAS, SamplingParams
from tests import sampler_reference as ref

VOCAB = 257
ROWS = 32
HISTORY = 24

# One compiled function per shape, shared by the tests.
sample = jax.jit(sampler.sample, static_argnames="num_top_logprobs")
apply_penalties = jax.jit(sampler.apply_penalties)
apply_filters = jax.jit(sampler.apply_filters)
prompt_logprobs = jax.jit(sampler.compute_prompt_logprobs, static_argnames="k")


def random_logits(seed: int, rows: int = ROWS) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((rows, VOCAB)) * 3).astype(np.float32)


def random_params(rng: np.random.Generator) -> SamplingParams:
    """A random mix of every sampling feature, greedy included."""
    num_bias = int(rng.integers(0, 5))
    return SamplingParams(
        temperature=0.0 if rng.random() < 0.25 else float(rng.uniform(0.3, 1.5)),
        top_k=int(rng.choice([-1, 1, 3, 20, 100, VOCAB, VOCAB + 10])),
        top_p=float(rng.choice([1.0, 0.3, 0.8, 0.95])),
        min_p=float(rng.choice([0.0, 0.05, 0.2])),
        repetition_penalty=float(rng.choice([1.0, 0.8, 1.3])),
        presence_penalty=float(rng.choice([0.0, -0.5, 0.7])),
        frequency_penalty=float(rng.choice([0.0, 0.4, -0.3])),
        logit_bias={
            int(t): float(rng.uniform(-5, 5))
            for t in rng.choice(VOCAB, size=num_bias, replace=False)
        },
    )


def random_row(
    rng: np.random.Generator, logits_row: np.ndarray, params: SamplingParams, seed: int
) -> SamplingRow:
    """History drawn from the row's 40 likeliest tokens, with repeats, so penalties bite."""
    likely = np.argsort(-logits_row)[:40]
    prompt = rng.choice(likely, size=int(rng.integers(1, 12))).astype(np.int32)
    output = [int(t) for t in rng.choice(likely, size=int(rng.integers(0, 12)))]
    return SamplingRow(params, prompt, output, seed)


@pytest.fixture(scope="module")
def mixed_batch():
    """32 rows, each with its own random parameters, history and seed."""
    rng = np.random.default_rng(0)
    logits = random_logits(1)
    rows = [random_row(rng, logits[i], random_params(rng), seed=1000 + i) for i in range(ROWS)]
    return logits, rows


def reference_penalized(logits: np.ndarray, rows: list[SamplingRow]) -> np.ndarray:
    return np.stack(
        [
            ref.penalized_logits(logits[i], r.params, list(r.prompt_token_ids), r.output_token_ids)
            for i, r in enumerate(rows)
        ]
    )


def test_penalties_and_logit_bias_equal_reference(mixed_batch):
    logits, rows = mixed_batch
    md = prepare_sampling_metadata(rows, ROWS, VOCAB, HISTORY)
    got = np.asarray(apply_penalties(logits, md))
    np.testing.assert_allclose(got, reference_penalized(logits, rows), rtol=1e-6, atol=1e-5)


def test_without_penalties_history_can_be_empty():
    """No row with a penalty: history length 0 is enough and only logit_bias applies."""
    logits = random_logits(2, rows=4)
    rows = [
        SamplingRow(SamplingParams(logit_bias={3: 2.5, 200: -1.0}), np.arange(5), [7, 7], 1),
        SamplingRow(SamplingParams(temperature=0.0), np.arange(3), [1], 2),
    ]
    assert sampling_metadata.history_len_needed(rows) == 0
    md = prepare_sampling_metadata(rows, 4, VOCAB, 0)
    expected = reference_penalized(logits[:2], rows)
    np.testing.assert_allclose(np.asarray(apply_penalties(logits, md))[:2], expected, atol=1e-6)


def test_greedy_rows_take_argmax_of_penalized_logits(mixed_batch):
    logits, rows = mixed_batch
    greedy_rows = [
        SamplingRow(
            SamplingParams(
                temperature=0.0,
                repetition_penalty=r.params.repetition_penalty,
                presence_penalty=r.params.presence_penalty,
                frequency_penalty=r.params.frequency_penalty,
                logit_bias=r.params.logit_bias,
            ),
            r.prompt_token_ids,
            r.output_token_ids,
            r.seed,
        )
        for r in rows[:24]
    ]
    md = prepare_sampling_metadata(greedy_rows, ROWS, VOCAB, HISTORY)  # 8 padded rows
    tokens = np.asarray(sample(logits, md).token_ids)
    expected = reference_penalized(logits[:24], greedy_rows).argmax(axis=-1)
    np.testing.assert_array_equal(tokens[:24], expected)
    # Padded rows behave as greedy rows with nothing applied.
    np.testing.assert_array_equal(tokens[24:], logits[24:].argmax(axis=-1))


FILTER_CASES = [
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.0, top_k=1),
    SamplingParams(temperature=1.3, top_k=5),
    SamplingParams(temperature=1.0, top_k=VOCAB - 1),
    SamplingParams(temperature=1.0, top_k=VOCAB),
    SamplingParams(temperature=1.0, top_k=10 * VOCAB),
    SamplingParams(temperature=1.0, top_p=0.05),
    SamplingParams(temperature=0.5, top_p=0.5),
    SamplingParams(temperature=1.0, top_p=0.9),
    SamplingParams(temperature=2.0, top_p=0.999),
    SamplingParams(temperature=1.0, min_p=0.05),
    SamplingParams(temperature=0.8, min_p=0.3),
    SamplingParams(temperature=1.0, min_p=1.0),
    SamplingParams(temperature=0.9, top_k=30, top_p=0.7),
    SamplingParams(temperature=1.2, top_k=50, top_p=0.95, min_p=0.02),
    SamplingParams(temperature=0.6, top_p=0.8, min_p=0.1),
]


def assert_not_at_rounding_boundary(logits_row: np.ndarray, params: SamplingParams) -> None:
    """Guards the fixture: no token's cumulative mass or min-p ratio within float32
    rounding of its threshold, where two correct implementations may disagree."""
    x = logits_row.astype(np.float64) / params.temperature
    order = np.argsort(-x)
    if params.top_k != -1:
        x[order[params.top_k :]] = -np.inf
    probs = np.exp(x - x.max())
    if params.top_p < 1.0:
        mass_before = np.cumsum(probs[order] / probs.sum()) - probs[order] / probs.sum()
        assert np.abs(mass_before - params.top_p).min() > 1e-5
    if 0.0 < params.min_p < 1.0:
        assert np.abs(probs - params.min_p).min() > 1e-5


def test_each_filter_allows_exactly_the_reference_set():
    logits = random_logits(3, rows=len(FILTER_CASES))
    rows = [SamplingRow(p, np.array([0], np.int32), [], seed=i) for i, p in enumerate(FILTER_CASES)]
    md = prepare_sampling_metadata(rows, len(rows), VOCAB, 0)
    filtered = np.asarray(apply_filters(logits, md))
    for i, params in enumerate(FILTER_CASES):
        assert_not_at_rounding_boundary(logits[i], params)
        allowed = ref.allowed_tokens(logits[i], params)
        assert allowed.any()
        np.testing.assert_array_equal(np.isfinite(filtered[i]), allowed, err_msg=str(params))
        np.testing.assert_allclose(
            filtered[i][allowed], logits[i][allowed] / params.temperature, rtol=1e-6
        )


def test_filters_of_mixed_batch_equal_reference(mixed_batch):
    """Every row of a batch mixing all features gets its own filter set."""
    logits, rows = mixed_batch
    md = prepare_sampling_metadata(rows, ROWS, VOCAB, HISTORY)
    penalized = np.asarray(apply_penalties(logits, md))
    filtered = np.asarray(apply_filters(penalized, md))
    for i, row in enumerate(rows):
        if row.params.temperature == 0.0:
            np.testing.assert_array_equal(filtered[i], penalized[i])  # greedy: untouched
            continue
        assert_not_at_rounding_boundary(penalized[i], row.params)
        allowed = ref.allowed_tokens(penalized[i], row.params)
        np.testing.assert_array_equal(np.isfinite(filtered[i]), allowed, err_msg=str(row.params))


def many_seeds(logits_row: np.ndarray, params: SamplingParams, num: int, first_seed: int = 0):
    """One row's sampled tokens for seeds first_seed .. first_seed + num - 1."""
    rows = [SamplingRow(params, np.array([0], np.int32), [], first_seed + s) for s in range(num)]
    md = prepare_sampling_metadata(rows, num, VOCAB, 0)
    return np.asarray(sample(np.broadcast_to(logits_row, (num, VOCAB)), md).token_ids)


@pytest.mark.parametrize("case", [2, 7, 11, 13, 14, 15])
def test_sampled_tokens_lie_in_the_allowed_set(case):
    params = FILTER_CASES[case]
    logits_row = random_logits(4, rows=1)[0]
    tokens = many_seeds(logits_row, params, 512)
    allowed = ref.allowed_tokens(logits_row, params)
    assert allowed[tokens].all()
    assert len(set(tokens.tolist())) > 1  # the seeds do give different draws


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.9, top_k=40, top_p=0.8, min_p=0.02),
    ],
    ids=["temperature", "top_k+top_p+min_p"],
)
def test_empirical_distribution_matches_reference_probabilities(params):
    """4096 seeds; chi-square goodness of fit, small expected bins merged into one."""
    num = 4096
    logits_row = random_logits(5, rows=1)[0] / 1.5
    counts = np.bincount(many_seeds(logits_row, params, num), minlength=VOCAB)
    expected = ref.sampling_probs(logits_row, params) * num
    assert counts[expected == 0].sum() == 0
    big = expected >= 5
    observed = np.append(counts[big], counts[~big].sum())
    expected_bins = np.append(expected[big], expected[~big].sum())
    if expected_bins[-1] == 0:
        observed, expected_bins = observed[:-1], expected_bins[:-1]
    assert len(observed) >= 10
    _, p_value = scipy.stats.chisquare(observed, expected_bins)
    assert p_value > 1e-3, p_value
    total_variation = 0.5 * np.abs(counts / num - expected / num).sum()
    assert total_variation < 0.08, total_variation


def test_same_seed_same_token_alone_or_in_a_batch_of_32(mixed_batch):
    logits, rows = mixed_batch
    md = prepare_sampling_metadata(rows, ROWS, VOCAB, HISTORY)
    batched = np.asarray(sample(logits, md).token_ids)
    # The same rows in another order, beside other rows: position must not matter.
    perm = np.random.default_rng(6).permutation(ROWS)
    md_perm = prepare_sampling_metadata([rows[j] for j in perm], ROWS, VOCAB, HISTORY)
    permuted = np.asarray(sample(logits[perm], md_perm).token_ids)
    np.testing.assert_array_equal(permuted, batched[perm])
    for i, row in enumerate(rows):
        alone = prepare_sampling_metadata([row], 1, VOCAB, HISTORY)
        assert int(sample(logits[i : i + 1], alone).token_ids[0]) == batched[i], i
    # And the draw does depend on the seed: other seeds give other tokens somewhere.
    reseeded = [
        SamplingRow(r.params, r.prompt_token_ids, r.output_token_ids, r.seed + 7) for r in rows
    ]
    md_reseeded = prepare_sampling_metadata(reseeded, ROWS, VOCAB, HISTORY)
    assert (np.asarray(sample(logits, md_reseeded).token_ids) != batched).any()


def test_row_keys_are_fold_in_of_seed_and_step():
    seeds = [0, 5, 2**31 + 7, 2**32 - 1]
    rows = [SamplingRow(SamplingParams(), np.array([1]), [2] * n, s) for n, s in enumerate(seeds)]
    md = prepare_sampling_metadata(rows, len(rows), VOCAB, 0)
    got = jax.random.key_data(sampler.row_keys(md))
    for n, seed in enumerate(seeds):
        key = jax.random.fold_in(jax.random.key(seed, impl="threefry2x32"), n)
        np.testing.assert_array_equal(got[n], jax.random.key_data(key))
    # Seeds beyond 32 bits stay distinct from their low halves.
    wide = [SamplingRow(SamplingParams(), np.array([1]), [], s) for s in (3, 2**40 + 3)]
    keys = jax.random.key_data(sampler.row_keys(prepare_sampling_metadata(wide, 2, VOCAB, 0)))
    assert (np.asarray(keys[0]) != np.asarray(keys[1])).any()


def test_logprobs_are_log_softmax_of_raw_logits(mixed_batch):
    logits, rows = mixed_batch
    md = prepare_sampling_metadata(rows, ROWS, VOCAB, HISTORY)
    out = sample(logits, md, num_top_logprobs=sampler.K_MAX)
    expected = ref.log_softmax(logits)
    tokens = np.asarray(out.token_ids)
    chosen = expected[np.arange(ROWS), tokens]
    np.testing.assert_allclose(np.asarray(out.logprobs), chosen, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(out.ranks), 1 + (expected > chosen[:, None]).sum(-1))
    top_ids = np.argsort(-expected, axis=-1, kind="stable")[:, : sampler.K_MAX]
    np.testing.assert_array_equal(np.asarray(out.top_token_ids), top_ids)
    np.testing.assert_allclose(
        np.asarray(out.top_logprobs), np.take_along_axis(expected, top_ids, -1), atol=1e-5
    )


@pytest.mark.parametrize("k", [0, 5])
def test_prompt_logprobs_are_log_softmax_of_raw_logits(k):
    num_tokens, num_real = 40, 33
    logits = random_logits(7, rows=num_tokens)
    next_ids = np.random.default_rng(8).integers(0, VOCAB, num_tokens).astype(np.int32)
    next_ids[num_real:] = -1  # padding positions
    logprobs, top_logprobs, top_ids = prompt_logprobs(logits, next_ids, k=k)
    expected = ref.log_softmax(logits)[:num_real]
    np.testing.assert_allclose(
        np.asarray(logprobs)[:num_real],
        expected[np.arange(num_real), next_ids[:num_real]],
        atol=1e-5,
    )
    expected_ids = np.argsort(-expected, axis=-1, kind="stable")[:, :k]
    assert top_ids.shape == (num_tokens, k)
    np.testing.assert_array_equal(np.asarray(top_ids)[:num_real], expected_ids)
    np.testing.assert_allclose(
        np.asarray(top_logprobs)[:num_real],
        np.take_along_axis(expected, expected_ids, -1),
        atol=1e-5,
    )


def test_sample_compiles_once_for_every_parameter_mix(mixed_batch):
    logits, rows = mixed_batch
    # jit caches are shared per Python function: wrap sample in a function of this test's
    # own, so the count sees only the calls below.
    fresh = jax.jit(lambda logits, md: sampler.sample(logits, md))
    row = rows[0]
    mixes = [
        rows,  # everything mixed
        [SamplingRow(SamplingParams(temperature=0.0), row.prompt_token_ids, [], 1)] * 3,
        [SamplingRow(SamplingParams(top_k=4, top_p=0.5), row.prompt_token_ids, [], 2)] * ROWS,
        [SamplingRow(SamplingParams(min_p=0.5, logit_bias={1: 3.0}), row.prompt_token_ids, [], 3)],
    ]
    for mix in mixes:
        fresh(
            logits, prepare_sampling_metadata(mix, ROWS, VOCAB, HISTORY)
        ).token_ids.block_until_ready()
    assert fresh._cache_size() == 1


def test_bad_rows_raise_naming_the_field():
    prompt = np.array([1, 2], np.int32)
    too_many = {t: 1.0 for t in range(MAX_LOGIT_BIAS + 1)}
    with pytest.raises(ValueError, match="^logit_bias"):
        prepare_sampling_metadata(
            [SamplingRow(SamplingParams(logit_bias=too_many), prompt, [], 0)], 1, VOCAB, 4
        )
    with pytest.raises(ValueError, match="^logit_bias"):
        prepare_sampling_metadata(
            [SamplingRow(SamplingParams(logit_bias={VOCAB: 1.0}), prompt, [], 0)], 1, VOCAB, 4
        )
    long_row = SamplingRow(SamplingParams(presence_penalty=0.5), prompt, [3, 4, 5], 0)
    assert sampling_metadata.history_len_needed([long_row]) == 5
    with pytest.raises(ValueError, match="^max_len"):
        prepare_sampling_metadata([long_row], 1, VOCAB, 4)
    with pytest.raises(ValueError, match="^num_rows"):
        prepare_sampling_metadata([long_row, long_row], 1, VOCAB, 8)


@pytest.mark.parametrize("temperature", [1.0, 0.5, 1e-3])
def test_largest_logit_bias_wins_even_when_it_overflows(temperature):
    """A bias of the largest float32 makes its token certain. Divided by a temperature
    < 1, or by a repetition penalty < 1, the logit overflows to +inf; the token must
    still win every draw (not turn into NaN and be dropped)."""
    num = 64
    logits_row = random_logits(9, rows=1)[0]
    target = int(np.argmin(logits_row))  # the least likely token without the bias
    plain = SamplingParams(temperature=temperature)
    penalized = SamplingParams(temperature=temperature, repetition_penalty=0.5)
    # SamplingParams bounds a bias to +-100 (OpenAI's rule) at construction; the sampler
    # itself must stay safe for whatever reaches it, so the bias is set past that check.
    for params in (plain, penalized):
        params.logit_bias = {target: FLOAT32_MAX}
    prompt = np.array([target], np.int32)  # the penalty applies to tokens seen
    rows = [SamplingRow(plain if s % 2 else penalized, prompt, [], s) for s in range(num)]
    md = prepare_sampling_metadata(rows, num, VOCAB, HISTORY)
    logits = np.broadcast_to(logits_row, (num, VOCAB))
    filtered = np.asarray(apply_filters(apply_penalties(logits, md), md))
    assert not np.isnan(filtered).any()
    np.testing.assert_array_equal(np.asarray(sample(logits, md).token_ids), target)


def test_numpy_integer_seeds_pack_like_python_ints():
    prompt = np.array([1], np.int32)
    seeds = [7, 2**63 + 5, -3]
    numpy_seeds = [np.int64(7), np.uint64(2**63 + 5), np.int64(-3)]
    packed = [
        prepare_sampling_metadata(
            [SamplingRow(SamplingParams(), prompt, [], s) for s in ss], 3, VOCAB, 0
        ).seeds
        for ss in (seeds, numpy_seeds)
    ]
    np.testing.assert_array_equal(packed[1], packed[0])
    expected = [((s % 2**64) >> 32, s % 2**32) for s in seeds]
    np.testing.assert_array_equal(packed[0], np.array(expected, np.uint32))


def test_unpackable_row_is_reported_and_left_as_padding(mixed_batch):
    """With row_errors, one row that cannot be packed does not fail the batch: it is
    padding, its error is reported, and the other rows are packed as usual."""
    _, rows = mixed_batch
    too_many = SamplingParams()  # more entries than SamplingParams accepts: set past its check
    too_many.logit_bias = {t: 1.0 for t in range(MAX_LOGIT_BIAS + 1)}
    bad = SamplingRow(
        too_many,
        rows[1].prompt_token_ids,
        rows[1].output_token_ids,
        rows[1].seed,
    )
    errors: dict[int, str] = {}
    got = prepare_sampling_metadata([rows[0], bad, rows[2]], 4, VOCAB, HISTORY, errors)
    assert list(errors) == [1] and errors[1].startswith("logit_bias: at most")
    good = prepare_sampling_metadata([rows[0], rows[0], rows[2]], 4, VOCAB, HISTORY)
    padding = prepare_sampling_metadata([], 4, VOCAB, HISTORY)
    for name, leaf, good_leaf, pad_leaf in zip(
        sampling_metadata.SamplingMetadata.__dataclass_fields__,
        jax.tree.leaves(got),
        jax.tree.leaves(good),
        jax.tree.leaves(padding),
        strict=True,
    ):
        np.testing.assert_array_equal(leaf[[0, 2, 3]], good_leaf[[0, 2, 3]], err_msg=name)
        np.testing.assert_array_equal(leaf[1], pad_leaf[1], err_msg=name)


# ----- work skipped at run time (lax.cond on flags read off the metadata) ---------------


def _counting_sampler(monkeypatch, skip_unwanted_logprobs=True):
    """A freshly traced `sample` whose draw (the full path: filters' threshold searches,
    Gumbel noise) and log-prob pass count their executions; returns (function, counts).
    The wrappers are new functions, so `lax.cond` traces them afresh."""
    counts = {"draw": 0, "logprobs": 0}

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            jax.debug.callback(lambda: counts.__setitem__(name, counts[name] + 1))
            return fn(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(sampler, "_draw", counted("draw", sampler._draw))
    monkeypatch.setattr(sampler, "_logprobs", counted("logprobs", sampler._logprobs))
    jitted = jax.jit(
        lambda logits, md: sampler.sample(
            logits, md, sampler.K_MAX, skip_unwanted_logprobs=skip_unwanted_logprobs
        )
    )

    def fn(logits, md):
        counts.update(draw=0, logprobs=0)  # this call's executions only
        out = jax.block_until_ready(jitted(logits, md))
        jax.effects_barrier()  # the callbacks have run once this returns
        return out

    return fn, counts


def _full_path_tokens(monkeypatch, logits, md):
    """Tokens of the sampler with nothing skipped (JAXSERVE_SAMPLER=full)."""
    monkeypatch.setenv(sampler.SAMPLER_ENV_VAR, "full")
    tokens = np.asarray(jax.jit(lambda x, m: sampler.sample(x, m).token_ids)(logits, md))
    monkeypatch.delenv(sampler.SAMPLER_ENV_VAR)
    return tokens


def _greedy(rows):
    return [
        SamplingRow(
            SamplingParams(temperature=0.0, **kw), r.prompt_token_ids, r.output_token_ids, r.seed
        )
        for r, kw in zip(rows, [{}, {"logit_bias": {5: 9.0}}] + [{}] * len(rows), strict=False)
    ]


def test_all_greedy_step_costs_an_argmax_and_gives_the_same_tokens(mixed_batch, monkeypatch):
    """Every row greedy, no log-probs: neither the draw nor the log-prob pass runs, and the
    tokens are the full path's (argmax of the penalized logits, logit_bias included)."""
    logits, rows = mixed_batch
    fn, counts = _counting_sampler(monkeypatch)
    greedy_rows = _greedy(rows[:20])
    md = prepare_sampling_metadata(greedy_rows, ROWS, VOCAB, 0)
    out = fn(logits, md)
    tokens = np.asarray(out.token_ids)
    assert counts == {"draw": 0, "logprobs": 0}
    np.testing.assert_array_equal(tokens, _full_path_tokens(monkeypatch, logits, md))
    expected = reference_penalized(logits[:20], greedy_rows).argmax(axis=-1)
    np.testing.assert_array_equal(tokens[:20], expected)
    np.testing.assert_array_equal(tokens[20:], logits[20:].argmax(axis=-1))
    assert not np.any(np.asarray(out.top_logprobs)) and not np.any(np.asarray(out.logprobs))


def test_mixed_batch_takes_the_full_path(mixed_batch, monkeypatch):
    """One sampled row among greedy ones (or one row asking for log-probs): the
    draw (resp. the log-prob pass) runs, and the tokens are the full path's."""
    logits, rows = mixed_batch
    fn, counts = _counting_sampler(monkeypatch)
    sampled = SamplingRow(
        SamplingParams(temperature=0.9, top_p=0.8), rows[0].prompt_token_ids, [], 7
    )
    mix = _greedy(rows[:10]) + [sampled]
    md = prepare_sampling_metadata(mix, ROWS, VOCAB, HISTORY)
    tokens = np.asarray(fn(logits, md).token_ids)
    assert counts == {"draw": 1, "logprobs": 0}
    np.testing.assert_array_equal(tokens, _full_path_tokens(monkeypatch, logits, md))
    # The sampled row draws what it draws alone (its own seed), not an argmax.
    alone = prepare_sampling_metadata([sampled], ROWS, VOCAB, 0)
    assert tokens[10] == np.asarray(fn(logits[[10] * ROWS], alone).token_ids)[0]

    wants = SamplingRow(
        SamplingParams(temperature=0.0, logprobs=2), rows[1].prompt_token_ids, [], 1
    )
    md = prepare_sampling_metadata(_greedy(rows[:10]) + [wants], ROWS, VOCAB, 0)
    out = fn(logits, md)
    assert counts == {"draw": 0, "logprobs": 1}
    expected = ref.log_softmax(logits)[np.arange(ROWS), np.asarray(out.token_ids)]
    np.testing.assert_allclose(np.asarray(out.logprobs), expected, atol=1e-5)
    np.testing.assert_array_equal(
        np.asarray(out.token_ids), _full_path_tokens(monkeypatch, logits, md)
    )


def test_whole_mixed_batch_tokens_do_not_depend_on_skipping(mixed_batch, monkeypatch):
    """The random mix of every feature: same tokens with and without run-time skipping."""
    logits, rows = mixed_batch
    md = prepare_sampling_metadata(rows, ROWS, VOCAB, HISTORY)
    fn, _ = _counting_sampler(monkeypatch)
    np.testing.assert_array_equal(
        np.asarray(fn(logits, md).token_ids), _full_path_tokens(monkeypatch, logits, md)
    )


def test_first_argmax_equals_numpy_argmax_with_ties_nan_and_inf():
    """`first_argmax` is NumPy's argmax row by row: the first index on ties, the first
    NaN in a row with NaNs, index 0 in an all -inf row; random rows of both shapes the
    engine runs (one row, many rows)."""
    rng = np.random.default_rng(7)
    rows = rng.standard_normal((64, 300)).astype(np.float32)
    rows[1, [5, 40, 299]] = 50.0  # a tie of three maxima
    rows[2, [17, 90]] = np.nan  # NaNs: the first wins, as in np.argmax
    rows[3, :] = -np.inf
    rows[4, 299] = np.inf
    rows[5, :] = 1.0  # every entry ties
    rows[6, [0, 3]] = [np.nan, 100.0]
    rows[7, :] = np.round(rows[7] * 2) / 2  # many small ties
    for x in (rows, rows[:1], rows[1:2], rows[2:3]):
        got = np.asarray(jax.jit(sampler.first_argmax)(jnp.asarray(x)))
        assert got.dtype == np.int32
        np.testing.assert_array_equal(got, np.argmax(x, axis=-1))


@pytest.mark.parametrize("top_p", [1e-40, 1e-45, 1.2e-38])
def test_a_top_p_below_float32s_smallest_normal_keeps_the_most_likely_token(top_p):
    """A top_p of 1e-40 is a float32 denormal, which the device flushed to 0: no token was
    kept and the request ended at once with an empty text (fresh-user trial). Any top_p
    that small keeps exactly the most likely token, whatever the seed."""
    params = SamplingParams(temperature=1.0, top_p=top_p)
    params.validate()
    logits_row = random_logits(5, rows=1)[0]
    tokens = many_seeds(logits_row, params, 64)
    assert (tokens == np.argmax(logits_row)).all(), tokens
