"""The handshake's checks of a remote replica (`router.identity`, `router.remote.parse_hello`)
and the loopback rule of --replica-listen, without processes."""

from __future__ import annotations

import dataclasses
import json
import shutil

import msgpack
import pytest

from jaxserve.config import DEMO_MODEL_DIR, EngineConfig
from jaxserve.ipc import PROTOCOL_VERSION, ReplicaHello, encode
from jaxserve.router.identity import FIELDS, first_difference, model_identity
from jaxserve.router.options import RouterOptions
from jaxserve.router.remote import parse_hello


def _config(model, **cache) -> EngineConfig:
    config = EngineConfig(model=str(model), served_model_name="demo")
    config.cache = dataclasses.replace(config.cache, **cache)
    return config


def test_identity_names_each_field_that_differs(tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(DEMO_MODEL_DIR, copy)
    base = model_identity(_config(DEMO_MODEL_DIR))
    assert set(base) == set(FIELDS)
    # The same files elsewhere, the config.json reformatted: the same model.
    hf = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps(hf, indent=7))
    assert first_difference(base, model_identity(_config(copy))) is None
    assert first_difference(base, model_identity(_config(copy, block_size=32))) == (
        "block_size: the frontend serves 16, the replica 32"
    )
    hf["rms_norm_eps"] = hf.get("rms_norm_eps", 1e-6) * 2
    (copy / "config.json").write_text(json.dumps(hf))
    assert first_difference(base, model_identity(_config(copy))).startswith("config_sha256: ")
    (copy / "config.json").write_text((DEMO_MODEL_DIR / "config.json").read_text())
    tok = copy / "tokenizer.json"
    tok.write_text(tok.read_text() + " ")  # one byte more
    assert first_difference(base, model_identity(_config(copy))).startswith("tokenizer_sha256: ")
    other = dict(base, dtype="bfloat16")
    assert first_difference(base, other) == (
        f"dtype: the frontend serves {base['dtype']!r}, the replica 'bfloat16'"
    )


def test_parse_hello():
    me = model_identity(_config(DEMO_MODEL_DIR))
    ok = encode(ReplicaHello(PROTOCOL_VERSION, me, "host pid 1"))
    assert parse_hello(ok, me) == (None, "host pid 1")
    newer = encode(ReplicaHello(PROTOCOL_VERSION + 1, {"anything": 1}, "x"))
    assert parse_hello(newer, me)[0] == (
        f"protocol_version: the frontend speaks {PROTOCOL_VERSION}, the replica "
        f"{PROTOCOL_VERSION + 1}"
    )
    # A future version's hello with fields this one does not know: still the version.
    future = msgpack.packb(["ReplicaHello", {"protocol": 99, "new_field": [1, 2]}])
    assert parse_hello(future, me)[0].startswith("protocol_version: ")
    for junk in (b"", b"\xc1", msgpack.packb([1, 2, 3]), msgpack.packb(["Shutdown", {}])):
        assert parse_hello(junk, me) == ("handshake: not a jaxserve ReplicaHello message", "")
    no_identity = msgpack.packb(["ReplicaHello", {"protocol": PROTOCOL_VERSION}])
    assert parse_hello(no_identity, me)[0] == "identity: missing from the handshake"
    wrong = encode(ReplicaHello(PROTOCOL_VERSION, dict(me, max_model_len=7), "y" * 500))
    refusal, name = parse_hello(wrong, me)
    assert refusal.startswith("max_model_len: ") and len(name) == 200


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "127.0.0.2"])
def test_loopback_listen_needs_no_flag(host):
    assert RouterOptions(replica_listen=(host, 0)).replica_listen == (host, 0)


@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3", "example.org"])
def test_listen_beyond_loopback_needs_allow_remote(host):
    with pytest.raises(ValueError, match=r"replica-listen: .* --allow-remote"):
        RouterOptions(replica_listen=(host, 7000))
    assert RouterOptions(replica_listen=(host, 7000), allow_remote=True).allow_remote


def test_listen_ipv6_is_refused_by_name():
    with pytest.raises(ValueError, match=r"replica-listen: IPv6 addresses \(::1\)"):
        RouterOptions(replica_listen=("::1", 7000))
