"""The offline `LLM` and the gRPC server apply the same request rules: each case runs on
both (the LLM over the session's tiny engine, the server over the mock engine with the
same max_model_len, since the rules live before the engine) and both must refuse it with
an error naming the same field, or both accept it."""

from __future__ import annotations

import grpc
import pytest

from jaxserve.sampling_params import MAX_N, SamplingParams


@pytest.fixture(scope="module")
def both(tiny_engine, tiny_moe_dir, mock_model_dir):
    from server_harness import ServerProcess

    from jaxserve.frontend.client import JaxserveClient
    from jaxserve.llm import LLM

    llm = LLM.from_engine(tiny_engine, tokenizer=tiny_moe_dir)
    limit = tiny_engine.max_model_len
    model = mock_model_dir
    srv = ServerProcess(
        model,
        extra_args=("--engine-class", "mock_engine:MockEngineCore", "--max-model-len", str(limit)),
    ).wait_ready()
    client = JaxserveClient(srv.target)
    assert client.server_info().max_model_len == limit
    yield llm, client, limit
    client.close()
    srv.terminate(15)


def _offline_error(llm, prompt, **params) -> str | None:
    try:
        llm.generate([prompt], SamplingParams(temperature=0, **params))
    except ValueError as e:
        return str(e)
    return None


def _server_error(client, prompt, **params) -> str | None:
    try:
        client.complete(prompt, temperature=0, **params)
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, e.details()
        return e.details()
    return None


CASES = {
    # name: (prompt or a function of max_model_len, params, field of the error or None)
    "empty text": ("", {}, "prompt"),
    "empty token ids": ([], {}, "prompt"),
    "n above the limit": ([5, 6], dict(n=MAX_N + 1, max_tokens=1), "n"),
    "n at the limit": ([5, 6], dict(n=2, max_tokens=1), None),
    "max_tokens above the model length": ([5, 6], dict(max_tokens="limit"), "max_tokens"),
    "max_tokens filling the model length": ([5, 6], dict(max_tokens="limit-2"), None),
    "prompt as long as the model": ("limit", dict(max_tokens=1), "prompt"),
    "stop as one string": ([5, 6], dict(stop="\n", max_tokens=2), None),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_offline_and_server_agree(both, name):
    llm, client, limit = both
    prompt, params, field = CASES[name]
    prompt = [7] * limit if prompt == "limit" else prompt
    params = dict(params)
    if params.get("max_tokens") == "limit":
        params["max_tokens"] = limit
    elif params.get("max_tokens") == "limit-2":
        params["max_tokens"] = limit - 2
    if isinstance(params.get("stop"), str):
        server_params = {**params, "stop": [params["stop"]]}  # the proto field is a list
    else:
        server_params = params
    offline, server = (
        _offline_error(llm, prompt, **params),
        _server_error(client, prompt, **server_params),
    )
    if field is None:
        assert offline is None and server is None, (offline, server)
    else:
        assert offline is not None and server is not None, (offline, server)
        assert offline.split("[")[0].split(":")[0].startswith(field), offline
        assert server.startswith(field), server


def test_stop_string_is_a_list_of_one():
    assert SamplingParams(stop="\n").stop == ["\n"]
    SamplingParams(stop="\n").validate()
