"""`jaxserve serve` router flags: parsing, errors naming the flag, disjoint devices."""

from __future__ import annotations

import argparse

import pytest

from jaxserve.router.cli_args import add_router_arguments, router_options
from jaxserve.router.options import RouterOptions


def _parse(*argv: str) -> RouterOptions:
    parser = argparse.ArgumentParser()
    add_router_arguments(parser)
    return router_options(parser.parse_args(list(argv)))


def test_flags_and_defaults():
    assert _parse() == RouterOptions()
    opts = _parse("--replicas", "4", "--router-policy", "round-robin", "--router-weight", "2")
    assert (opts.replicas, opts.policy_name, opts.weight) == (4, "round-robin", 2.0)
    assert _parse("--replicas", "2").policy_name == "kv"
    opts = _parse(
        "--router-balance-abs", "3", "--router-balance-rel", "2", "--router-decode-weight",
        "0.5", "--router-share-limit", "1.25",
    )  # fmt: skip
    assert opts.kv_options() == {
        "balance_abs": 3.0, "balance_rel": 2.0, "decode_weight": 0.5, "share_limit": 1.25,
    }  # fmt: skip
    # inf turns the gate and the cap off: with decode weight 1, Dynamo's cost alone.
    dynamo = _parse(
        "--router-balance-abs", "inf", "--router-share-limit", "inf",
        "--router-decode-weight", "1",
    ).kv_options()  # fmt: skip
    assert (dynamo["balance_abs"], dynamo["share_limit"], dynamo["decode_weight"]) == (
        None, None, 1.0,
    )  # fmt: skip


@pytest.mark.parametrize(
    "argv, flag",
    [
        (("--replicas", "0"), "replicas"),
        (("--devices-per-replica", "0"), "devices-per-replica"),
        (("--router-weight", "-1"), "router-weight"),
        (("--router-temperature", "nan"), "router-temperature"),
        (("--router-balance-abs", "-1"), "router-balance-abs"),
        (("--router-balance-rel", "0.5"), "router-balance-rel"),
        (("--router-decode-weight", "inf"), "router-decode-weight"),
        (("--router-share-limit", "0.9"), "router-share-limit"),
    ],
)
def test_bad_values_name_the_flag(argv, flag):
    with pytest.raises(ValueError, match=flag):
        _parse(*argv)


def test_replica_listen_host_must_resolve():
    """A name that does not resolve is named as such, before the loopback rule asks for
    --allow-remote (which could not help); names that resolve pass on to that rule."""
    for more in ((), ("--allow-remote",)):
        with pytest.raises(ValueError) as e:
            _parse("--replica-listen", "nosuchhost.invalid:7000", *more)
        assert str(e.value).startswith("replica-listen: host nosuchhost.invalid does not resolve")
    assert _parse("--replica-listen", "localhost:7000").replica_listen == ("localhost", 7000)
    with pytest.raises(ValueError, match=r"replica-listen: IPv6 addresses \(::1\)"):
        _parse("--replica-listen", "[::1]:7000")  # IPv6's own words, not "does not resolve"


def test_each_replica_gets_a_disjoint_device_slice(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    opts = RouterOptions(replicas=3, devices_per_replica=2)
    slices = [opts.device_env(k, mesh_devices=1)["CUDA_VISIBLE_DEVICES"] for k in range(3)]
    assert slices == ["0,1", "2,3", "4,5"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "7,5,3,1")
    opts = RouterOptions(replicas=2)  # default: the mesh's size
    assert [opts.device_env(k, mesh_devices=2)["CUDA_VISIBLE_DEVICES"] for k in range(2)] == [
        "7,5",
        "3,1",
    ]
    with pytest.raises(ValueError, match="devices-per-replica"):
        RouterOptions(replicas=3).device_env(0, mesh_devices=2)
    assert RouterOptions().device_env(0, mesh_devices=8) == {}


def test_devices_per_replica_must_be_the_mesh_size():
    RouterOptions(replicas=2, devices_per_replica=4).check_mesh(4)
    RouterOptions(replicas=2).check_mesh(8)  # unset: the mesh's size
    with pytest.raises(ValueError, match=r"^devices-per-replica: 1 does not match .* = 2"):
        RouterOptions(replicas=2, devices_per_replica=1).check_mesh(2)


def test_serve_refuses_a_devices_per_replica_mismatch_before_starting():
    import subprocess
    import sys

    from jaxserve.config import DEMO_MODEL_DIR

    proc = subprocess.run(
        [sys.executable, "-m", "jaxserve.cli", "serve", "--model", str(DEMO_MODEL_DIR),
         "--replicas", "2", "--devices-per-replica", "1", "--mesh", "dp=2,tp=1"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "devices-per-replica: 1 does not match the mesh's dp x tp = 2" in proc.stderr
    assert "Traceback" not in proc.stderr
