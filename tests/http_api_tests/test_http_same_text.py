"""The OpenAI-compatible HTTP API, with the official `openai` client as the client: the
same text as the gRPC API of the same server and as the offline `LLM.generate` on the
same engine settings (greedy, token-id prompts, chat, n samples, stops, log-probs); the
chat prompt is rendered independently by transformers' apply_chat_template. The server
and the clients are the package's (conftest.py).
"""

from __future__ import annotations

import pytest

from http_api_tests.helpers import CHAT, CHATML, PROMPTS, TIMEOUT_S, http_request
from jaxserve import SamplingParams
from jaxserve.config import DEMO_MODEL_DIR

pytestmark = pytest.mark.slow


# ---------------------------------------------------------------- small endpoints


def test_models_health_version(server, client, model_name):
    assert model_name == DEMO_MODEL_DIR.name
    card = client.models.list().data[0]
    assert card.owned_by == "jaxserve" and card.model_extra["max_model_len"] == 512
    assert http_request("GET", server.http_url + "/health").status_code == 200
    from importlib.metadata import version

    assert http_request("GET", server.http_url + "/version").json() == {
        "version": version("jaxserve")
    }


# ---------------------------------------------------------------- same text, three paths


def test_greedy_completions_equal_grpc_and_offline(client, grpc_client, llm, model_name):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    offline = llm.generate(PROMPTS, params)
    # One request with four prompts (choice i is prompt i), and one streamed per prompt.
    batch = client.completions.create(
        model=model_name, prompt=PROMPTS, temperature=0, max_tokens=24,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    prompt_ids = [len(o.prompt_token_ids) for o in offline]
    assert batch.usage.prompt_tokens == sum(prompt_ids)
    assert batch.usage.completion_tokens == 24 * len(PROMPTS)
    assert batch.usage.total_tokens == sum(prompt_ids) + 24 * len(PROMPTS)
    for i, prompt in enumerate(PROMPTS):
        want = offline[i]
        assert batch.choices[i].text == want.text, prompt
        assert batch.choices[i].finish_reason == "length"
        grpc_text = "".join(
            d.text
            for d in grpc_client.generate(
                prompt, max_tokens=24, temperature=0, ignore_eos=True, timeout=TIMEOUT_S
            )
        )
        assert grpc_text == want.text, prompt
        chunks = list(
            client.completions.create(
                model=model_name, prompt=prompt, temperature=0, max_tokens=24, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
            )
        )  # fmt: skip
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text, prompt
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        usage = chunks[-1]
        assert usage.choices == [] and usage.usage.completion_tokens == 24
        assert usage.usage.prompt_tokens == prompt_ids[i]
        assert all(c.usage is None for c in chunks[:-1])


def test_token_id_prompt_equals_text_prompt(client, llm, model_name):
    ids = llm.get_tokenizer().encode("def ").ids
    by_ids = client.completions.create(model=model_name, prompt=ids, temperature=0, max_tokens=8)
    by_text = client.completions.create(
        model=model_name, prompt="def ", temperature=0, max_tokens=8
    )
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids)


def test_chat_equals_offline_on_transformers_rendering(client, llm, model_name):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)
    ids = list(
        hf.apply_chat_template(
            CHAT, chat_template=CHATML, add_generation_prompt=True, tokenize=True,
            return_dict=False,
        )
    )  # fmt: skip
    (want,) = llm.generate([ids], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    got = client.chat.completions.create(
        model=model_name, messages=CHAT, temperature=0, max_completion_tokens=20,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert got.object == "chat.completion"
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == want.text
    assert got.usage.prompt_tokens == len(ids)
    assert got.usage.completion_tokens == 20
    chunks = list(
        client.chat.completions.create(
            model=model_name, messages=CHAT, temperature=0, max_tokens=20, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )
    )  # fmt: skip
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
    assert chunks[-1].usage.prompt_tokens == len(ids)


def test_chat_default_max_tokens_is_the_room_left(client, model_name):
    # Unset max_tokens: up to max_model_len (512) - prompt; ignore_eos runs to it.
    got = client.chat.completions.create(
        model=model_name, messages=CHAT, temperature=0, extra_body={"ignore_eos": True}
    )
    assert got.choices[0].finish_reason == "length"
    assert got.usage.prompt_tokens + got.usage.completion_tokens == 512


# ---------------------------------------------------------------- sampling fields


def test_n_samples_equal_offline(client, llm, model_name):
    params = SamplingParams(n=3, temperature=0.9, top_k=40, seed=4321, max_tokens=16)
    (want,) = llm.generate(["def "], params)
    got = client.completions.create(
        model=model_name, prompt="def ", n=3, temperature=0.9, seed=4321, max_tokens=16,
        extra_body={"top_k": 40},
    )  # fmt: skip
    assert [c.index for c in got.choices] == [0, 1, 2]
    assert [c.text for c in got.choices] == [o.text for o in want.outputs]
    assert len({c.text for c in got.choices}) > 1
    # Streamed, with two prompts: choice i * n + j is sample j of prompt i.
    chunks = list(
        client.completions.create(
            model=model_name, prompt=["def ", "def "], n=3, temperature=0.9, seed=4321,
            max_tokens=16, stream=True, extra_body={"top_k": 40},
        )
    )  # fmt: skip
    texts: dict[int, str] = {}
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    assert sorted(texts) == list(range(6))
    assert [texts[i] for i in range(6)] == [o.text for o in want.outputs] * 2


def test_stop_string_and_stop_token(client, llm, model_name):
    params = SamplingParams(temperature=0, max_tokens=60, stop=["):"])
    (want,) = llm.generate(["def "], params)
    got = client.completions.create(
        model=model_name, prompt="def ", temperature=0, max_tokens=60, stop="):"
    )
    choice = got.choices[0]
    assert choice.text == want.text and "):" not in choice.text
    assert choice.finish_reason == "stop" and choice.model_extra["stop_reason"] == "):"
    # A stop token id (vLLM's extra): the first token greedy decoding makes.
    first = llm.generate(["def "], SamplingParams(temperature=0, max_tokens=1))[0].token_ids[0]
    got = client.completions.create(
        model=model_name, prompt="def ", temperature=0, max_tokens=10,
        extra_body={"stop_token_ids": [first]},
    )  # fmt: skip
    assert got.choices[0].finish_reason == "stop"
    assert got.choices[0].model_extra["stop_reason"] == first
    assert got.choices[0].text == ""


def test_logprobs_equal_offline(client, llm, model_name):
    (want,) = llm.generate(["import "], SamplingParams(temperature=0, max_tokens=6, logprobs=3))
    tok = llm.get_tokenizer()
    got = client.completions.create(
        model=model_name, prompt="import ", temperature=0, max_tokens=6, logprobs=3
    ).choices[0]
    lp = got.logprobs
    assert lp.tokens == [tok.decode([t], skip_special_tokens=False) for t in want.token_ids]
    assert lp.token_logprobs == pytest.approx([e[0] for e in want.outputs[0].logprobs], abs=1e-5)
    for top, ref in zip(lp.top_logprobs, want.outputs[0].logprobs, strict=True):
        assert len(top) == len({tok.decode([t], skip_special_tokens=False) for t, _ in ref[1]})
        assert max(top.values()) == pytest.approx(ref[1][0][1], abs=1e-5)
    assert lp.text_offset[0] == 0 and "".join(lp.tokens) == got.text
    # Chat: logprobs + top_logprobs, each entry with its bytes.
    chat = client.chat.completions.create(
        model=model_name, messages=CHAT, temperature=0, max_tokens=4, logprobs=True,
        top_logprobs=2,
    ).choices[0]  # fmt: skip
    content = chat.logprobs.content
    assert len(content) == 4
    assert "".join(e.token for e in content) == chat.message.content
    for e in content:
        assert len(e.top_logprobs) == 2
        assert e.top_logprobs[0].logprob == pytest.approx(e.logprob, abs=1e-5)  # greedy
        assert bytes(e.bytes) == e.token.encode()
