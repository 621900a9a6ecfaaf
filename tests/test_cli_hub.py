"""`jaxserve serve ORG/NAME`: Hugging Face model ids resolved through a Hub cache the
test writes, offline (jaxserve/hub.py), up to a served model loaded from the cache."""

from __future__ import annotations

import pytest

from jaxserve.cli import _engine_config, build_parser
from jaxserve.hub import looks_like_repo_id, resolve_model


def _write_hub_cache(home, repo_id: str, files: dict[str, str], revision: str = "0" * 40):
    """A Hub cache as huggingface_hub lays it out: refs/main names a snapshot folder."""
    repo = home / "hub" / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(revision)
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True)
    for name, text in files.items():
        (snapshot / name).write_text(text)
    return snapshot


@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    home = tmp_path / "hf_home"
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return home


def test_repo_id_shapes():
    assert looks_like_repo_id("Qwen/Qwen3-30B-A3B") and looks_like_repo_id("gpt2")
    assert looks_like_repo_id("org/name@main")
    assert not looks_like_repo_id("./models/x") and not looks_like_repo_id("/abs/x")
    assert not looks_like_repo_id("a/b/c")


def test_model_id_resolves_from_the_hf_cache_offline(offline_hub):
    snapshot = _write_hub_cache(offline_hub, "org/tiny", {"config.json": "{}"})
    assert resolve_model("org/tiny") == str(snapshot)
    config = _engine_config(build_parser().parse_args(["serve", "org/tiny"]), model=str(snapshot))
    assert config.model == str(snapshot) and config.served_model_name == "org/tiny"


def test_hf_hub_cache_variable_wins(offline_hub, tmp_path, monkeypatch):
    other = tmp_path / "elsewhere"
    snapshot = _write_hub_cache(other, "org/tiny", {"config.json": "{}"})
    monkeypatch.setenv("HF_HUB_CACHE", str(other / "hub"))
    assert resolve_model("org/tiny") == str(snapshot)


def test_model_id_missing_offline_names_the_cause(offline_hub):
    absent = "model: 'org/absent' is not a local folder.*HF_HUB_OFFLINE"
    with pytest.raises(ValueError, match=absent):
        resolve_model("org/absent")
    with pytest.raises(ValueError, match="neither a folder nor a Hugging Face model id"):
        resolve_model("no/such/folder")


def test_serve_a_model_id_from_the_cache(offline_hub):
    """`jaxserve serve org/name` end to end (mock engine): the frontend, the engine and the
    detokenizer all load the cached snapshot."""
    from mock_engine import write_mock_model_dir
    from server_harness import ServerProcess

    snapshot = _write_hub_cache(offline_hub, "org/mock", {})
    write_mock_model_dir(snapshot)
    srv = ServerProcess(
        "org/mock",  # type: ignore[arg-type]
        extra_args=("--engine-class", "mock_engine:MockEngineCore"),
    ).wait_ready()
    try:
        from jaxserve.frontend.client import JaxserveClient

        with JaxserveClient(srv.target) as client:
            assert client.server_info().max_model_len > 0
            assert client.complete([5, 6], max_tokens=3)[0].completion_tokens == 3
    finally:
        srv.terminate(15)
