"""`jaxserve bench`'s dataset loaders (jaxserve.benchmark.datasets): random, shared
prefix, ShareGPT (filtered as vLLM filters it), multi-turn and a text file of prompts."""

from __future__ import annotations

import json

import pytest

from jaxserve.benchmark import datasets
from jaxserve.config import DEMO_MODEL_DIR
from jaxserve.frontend.tokenizer import encode_prompt, load_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(DEMO_MODEL_DIR)


def test_random_dataset_lengths_range_and_seed(tokenizer):
    a = datasets.random_dataset(tokenizer, 50, input_len=40, output_len=10, range_ratio=0.5, seed=3)
    b = datasets.random_dataset(tokenizer, 50, input_len=40, output_len=10, range_ratio=0.5, seed=3)
    assert [s.turns[0].prompt for s in a] == [s.turns[0].prompt for s in b]
    reqs = [s.turns[0] for s in a]
    assert all(20 <= r.prompt_len <= 60 and len(r.prompt) == r.prompt_len for r in reqs)
    assert all(5 <= r.output_len <= 15 for r in reqs)
    assert len({r.prompt_len for r in reqs}) > 5  # lengths vary with a range ratio
    special = {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
    vocab = tokenizer.get_vocab_size()
    assert all(0 <= t < vocab and t not in special for r in reqs for t in r.prompt)
    fixed = datasets.random_dataset(tokenizer, 5, input_len=7, output_len=3)
    assert {(s.turns[0].prompt_len, s.turns[0].output_len) for s in fixed} == {(7, 3)}
    with pytest.raises(ValueError, match="input_len"):
        datasets.random_dataset(tokenizer, 5, input_len=0, output_len=3)
    with pytest.raises(ValueError, match="range_ratio"):
        datasets.random_dataset(tokenizer, 5, input_len=4, output_len=3, range_ratio=1.0)


def test_shared_prefix_dataset_shares_prefixes(tokenizer):
    sessions = datasets.shared_prefix_dataset(
        tokenizer, 12, prefix_len=16, suffix_len=4, output_len=5, num_prefixes=3, seed=1
    )
    prompts = [s.turns[0].prompt for s in sessions]
    assert all(len(p) == 20 for p in prompts)
    groups: dict[tuple, int] = {}
    for p in prompts:
        groups[tuple(p[:16])] = groups.get(tuple(p[:16]), 0) + 1
    assert sorted(groups.values()) == [4, 4, 4]
    assert len({tuple(p[16:]) for p in prompts}) == 12  # each suffix its own


def _sharegpt_file(tmp_path, tokenizer):
    long = "word " * 1200
    data = [
        {"conversations": [
            {"from": "human", "value": "Write a Python function that adds two numbers."},
            {"from": "gpt", "value": "def add(a, b):\n    return a + b\n"},
            {"from": "human", "value": "Now make it add three numbers, please."},
            {"from": "gpt", "value": "def add(a, b, c):\n    return a + b + c"},
        ]},
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]},
        {"conversations": [
            {"from": "human", "value": long}, {"from": "gpt", "value": "ok ok ok ok"},
        ]},
        {"conversations": [
            {"from": "human", "value": "Explain what a KV cache stores in a transformer."},
            {"from": "gpt", "value": "It keeps the keys and values of earlier tokens."},
        ]},
        {"conversations": [{"from": "human", "value": "only a question with no answer"}]},
    ]  # fmt: skip
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    return path, data


def test_sharegpt_dataset_filters_like_vllm(tmp_path, tokenizer):
    path, data = _sharegpt_file(tmp_path, tokenizer)
    sessions = datasets.sharegpt_dataset(tokenizer, path, 10, seed=0)
    got = {s.turns[0].prompt: s.turns[0] for s in sessions}
    # Kept: conversations 0 and 3; dropped: "hi" (< 4 tokens), the 1200-word prompt
    # (> 1024 tokens) and the one with no answer.
    assert set(got) == {data[0]["conversations"][0]["value"], data[3]["conversations"][0]["value"]}
    for conv in (data[0], data[3]):
        q, a = conv["conversations"][0]["value"], conv["conversations"][1]["value"]
        r = got[q]
        assert r.prompt_len == len(encode_prompt(tokenizer, q))
        assert r.output_len == len(tokenizer.encode(a, add_special_tokens=False).ids)
    assert len(datasets.sharegpt_dataset(tokenizer, path, 1)) == 1
    fixed = datasets.sharegpt_dataset(tokenizer, path, 10, output_len=7)
    assert {s.turns[0].output_len for s in fixed} == {7}
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"conversations": [{"value": "x"}]}]))
    with pytest.raises(ValueError, match="dataset_path.*'from'"):
        datasets.sharegpt_dataset(tokenizer, bad, 3)
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="dataset_path.*not JSON"):
        datasets.sharegpt_dataset(tokenizer, bad, 3)


def test_multi_turn_dataset_synthetic_and_from_sharegpt(tmp_path, tokenizer):
    sessions = datasets.multi_turn_dataset(
        tokenizer, 3, num_turns=4, input_len=12, output_len=5, seed=2
    )
    assert len(sessions) == 3 and all(s.chained and len(s.turns) == 4 for s in sessions)
    for t in (t for s in sessions for t in s.turns):
        assert isinstance(t.prompt, str) and t.output_len == 5
        assert t.prompt_len == len(encode_prompt(tokenizer, t.prompt))
    path, data = _sharegpt_file(tmp_path, tokenizer)
    convs = datasets.multi_turn_dataset(
        tokenizer, 10, num_turns=2, input_len=1, output_len=6, path=path
    )
    by_first = {s.turns[0].prompt: [t.prompt for t in s.turns] for s in convs}
    first = data[0]["conversations"]
    assert by_first[first[0]["value"]] == [first[0]["value"], first[2]["value"]]
    assert len(convs) == 5  # every conversation has a human turn
    with pytest.raises(ValueError, match="num_turns"):
        datasets.multi_turn_dataset(
            tokenizer, 1, num_turns=datasets.MAX_TURNS + 1, input_len=1, output_len=1
        )


def test_text_file_dataset(tmp_path, tokenizer):
    path = tmp_path / "prompts.txt"
    path.write_text("import \n\n   \ndef f(x):\\n    return\nclass A:\n")
    sessions = datasets.text_file_dataset(tokenizer, path, 5, output_len=9)
    prompts = [s.turns[0].prompt for s in sessions]
    assert prompts == [
        "import ",
        "def f(x):\n    return",
        "class A:",
        "import ",
        "def f(x):\n    return",
    ]
    assert all(s.turns[0].output_len == 9 for s in sessions)
    path.write_text("\n \n")
    with pytest.raises(ValueError, match="dataset_path"):
        datasets.text_file_dataset(tokenizer, path, 5, output_len=9)
