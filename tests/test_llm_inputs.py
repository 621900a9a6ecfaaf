"""The offline `LLM.generate`'s prompts: anything that is no text and no list of token ids
is a ValueError naming the prompt by its index (`prompts[i]`, `prompts[i][j]`), as every
other bad input of the offline API names its field; before, None raised TypeError
("'NoneType' object is not iterable") and 1.5 or True became token id 1 silently."""

from __future__ import annotations

import re

import pytest

from jaxserve import SamplingParams

PARAMS = SamplingParams(max_tokens=2, temperature=0)


@pytest.mark.parametrize(
    "prompts, field, words",
    [
        ([None], "prompts[0]", "expected a string or a list of token ids, got NoneType"),
        (["ok", 5], "prompts[1]", "got int"),
        (["ok", {"a": 1}], "prompts[1]", "a prompt dict has exactly one key"),
        ([{"prompt": "a", "prompt_token_ids": [1]}], "prompts[0]", "exactly one key"),
        ([{"prompt": 5}], "prompts[0].prompt", "expected a string, got int"),
        ([{"prompt_token_ids": [1, 2.5]}], "prompts[0][1]", "got 2.5"),
        (None, "prompts", "expected a string or a list of prompts, got NoneType"),
        (["ok", "a\ud800b"], "prompts[1]", "not valid Unicode text (a lone surrogate U+D800 at 1)"),
        (5, "prompts", "got int"),
        ([[1, 2], [3, 1.5]], "prompts[1][1]", "a token id must be an integer, got 1.5"),
        ([[1, True]], "prompts[0][1]", "a token id must be an integer, got True"),
        ([[1, None]], "prompts[0][1]", "got None"),
    ],
)
def test_a_prompt_that_is_no_text_or_ids_is_named(demo_llm, prompts, field, words):
    with pytest.raises(ValueError, match=f"^{re.escape(field)}: .*{re.escape(words)}"):
        demo_llm.generate(prompts, PARAMS)


def test_vllm_prompt_dicts_are_their_text_or_ids(demo_llm):
    # {"prompt": "a"} was iterated as a list of keys: the prompt "prompt" ran silently.
    ids = demo_llm.tokenizer.encode("def add(").ids
    by_text, by_dict, by_ids_dict = demo_llm.generate(
        ["def add(", {"prompt": "def add("}, {"prompt_token_ids": ids}], PARAMS
    )
    assert by_dict.prompt_token_ids == by_text.prompt_token_ids == by_ids_dict.prompt_token_ids
    assert by_dict.prompt == "def add(" and by_dict.outputs[0].text == by_text.outputs[0].text
    (single,) = demo_llm.generate({"prompt": "def add("}, PARAMS)  # one dict: one prompt
    assert single.prompt_token_ids == by_text.prompt_token_ids


def test_token_id_prompts_still_run(demo_llm):
    import numpy as np

    ids = demo_llm.tokenizer.encode("def add(").ids
    by_text, by_ids, by_array = demo_llm.generate(
        ["def add(", ids, np.array(ids, dtype=np.int64)], PARAMS
    )
    assert by_text.prompt_token_ids == by_ids.prompt_token_ids == by_array.prompt_token_ids
    assert by_text.token_ids == by_ids.token_ids == by_array.token_ids
