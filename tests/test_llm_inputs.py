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
        (["ok", {"a": 1}], "prompts[1]", "got dict"),
        ([[1, 2], [3, 1.5]], "prompts[1][1]", "a token id must be an integer, got 1.5"),
        ([[1, True]], "prompts[0][1]", "a token id must be an integer, got True"),
        ([[1, None]], "prompts[0][1]", "got None"),
    ],
)
def test_a_prompt_that_is_no_text_or_ids_is_named(demo_llm, prompts, field, words):
    with pytest.raises(ValueError, match=f"^{re.escape(field)}: .*{re.escape(words)}"):
        demo_llm.generate(prompts, PARAMS)


def test_token_id_prompts_still_run(demo_llm):
    import numpy as np

    ids = demo_llm.tokenizer.encode("def add(").ids
    by_text, by_ids, by_array = demo_llm.generate(
        ["def add(", ids, np.array(ids, dtype=np.int64)], PARAMS
    )
    assert by_text.prompt_token_ids == by_ids.prompt_token_ids == by_array.prompt_token_ids
    assert by_text.token_ids == by_ids.token_ids == by_array.token_ids
