"""`distributed.check_coordinator_host`: `serve` (every process) waits for the coordinator
address's host name to resolve before jax.distributed.initialize, with a WARNING at once,
and names the address when it never does (`frontend.server_address.wait_until_resolves`).
In-process with short waits: the command's own wait is initialize's 300 s."""

from __future__ import annotations

import pytest


def test_a_coordinator_that_does_not_resolve_is_named_after_a_wait(monkeypatch):
    """--coordinator-address nosuchhost.invalid:P (.invalid never resolves, RFC 6761): a
    follower waited out jax.distributed.initialize's 300 s with no word of why. `serve`
    checks the name first (`cli._cmd_serve`, every process): it is waited for (a pod's
    resolves once the pod runs) with a WARNING at once, then the error names the
    address. In-process with a 1 s wait: the command's own is initialize's 300 s."""
    from jaxserve.distributed import DistributedConfig, check_coordinator_host

    warnings = []
    monkeypatch.setattr(
        "jaxserve.frontend.server_address.logger.warning",
        lambda fmt, *args: warnings.append(fmt % args),
    )
    config = DistributedConfig("nosuchhost.invalid:1234", num_processes=2, process_id=1)
    with pytest.raises(ValueError) as error:
        check_coordinator_host(config, timeout_s=1.0)
    assert str(error.value).startswith(
        "distributed: coordinator address nosuchhost.invalid:1234: host "
        "nosuchhost.invalid does not resolve ("
    ), error.value
    assert ") after 1 s; " in str(error.value)
    assert str(error.value).endswith("JAX_COORDINATOR_ADDRESS: process 0's address)")
    assert len(warnings) == 1 and warnings[0].startswith(
        "distributed: host nosuchhost.invalid does not resolve yet ("
    ), warnings


def test_a_coordinator_name_that_resolves_late_is_waited_for(monkeypatch):
    """A name that resolves on the third try (a pod that starts late) passes the check:
    it is waited for, not refused."""
    import socket as socket_module

    from jaxserve.distributed import DistributedConfig, check_coordinator_host

    tries = []

    def getaddrinfo(host, *args, **kwargs):
        tries.append(host)
        if len(tries) < 3:
            raise socket_module.gaierror(socket_module.EAI_NONAME, "Name or service not known")
        return [(socket_module.AF_INET, socket_module.SOCK_STREAM, 6, "", ("10.0.0.7", 0))]

    monkeypatch.setattr("jaxserve.frontend.server_address.socket.getaddrinfo", getaddrinfo)
    monkeypatch.setattr("jaxserve.frontend.server_address.time.sleep", lambda s: None)
    config = DistributedConfig("jaxserve-0.jaxserve:61234", num_processes=2, process_id=1)
    check_coordinator_host(config, timeout_s=60)
    assert tries == ["jaxserve-0.jaxserve"] * 3
