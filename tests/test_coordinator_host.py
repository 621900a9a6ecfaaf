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


def test_a_follower_whose_coordinator_never_listens_ends_naming_the_address():
    """Nothing listens at the coordinator's port (process 0 never came):
    jax.distributed.initialize would wait out its timeout, then abort in C++ with a
    stack trace. `wait_for_coordinator` (the follower's wait before it) ends with one
    message naming the flag, the address and the wait. In-process with a 1 s wait."""
    import time

    from server_harness import free_port

    from jaxserve.distributed import DistributedConfig, wait_for_coordinator

    config = DistributedConfig(f"127.0.0.1:{free_port()}", num_processes=2, process_id=1)
    start = time.monotonic()
    with pytest.raises(ValueError) as error:
        wait_for_coordinator(config, timeout_s=1.0)
    took = time.monotonic() - start
    assert 1.0 <= took < 5.0, took  # the wait is spent, then no more
    message = str(error.value)
    assert message.startswith(
        f"distributed: coordinator address {config.coordinator_address}: nothing accepted a "
        "connection (Connection refused) within 1 s: "
    ), message
    assert "--coordinator-address" in message and "JAXSERVE_INIT_TIMEOUT_S" in message


def test_a_coordinator_that_starts_listening_late_is_waited_for():
    """Kubernetes peers start minutes apart: a coordinator port that accepts only after
    a second is waited for (the follower then goes on to jax.distributed.initialize)."""
    import socket
    import threading
    import time

    from server_harness import free_port

    from jaxserve.distributed import DistributedConfig, wait_for_coordinator

    port = free_port()
    accepted = threading.Event()

    def leader_starts_late() -> None:
        time.sleep(1.0)
        with socket.create_server(("127.0.0.1", port)) as server:
            server.settimeout(10)
            conn, _ = server.accept()
            conn.close()
            accepted.set()

    thread = threading.Thread(target=leader_starts_late)
    thread.start()
    start = time.monotonic()
    wait_for_coordinator(DistributedConfig(f"127.0.0.1:{port}", 2, 1), timeout_s=30)
    took = time.monotonic() - start
    thread.join(10)
    assert accepted.is_set() and 1.0 <= took < 10, took


@pytest.mark.parametrize(
    ("value", "expected"), [(None, 300), ("7", 7), ("0", "must be >= 1"), ("x", "integer")]
)
def test_init_timeout_comes_from_the_environment(value, expected):
    """JAXSERVE_INIT_TIMEOUT_S sets the start-up wait (default JAX's 300 s); a bad value
    names the variable."""
    from jaxserve.distributed import init_timeout_s

    env = {} if value is None else {"JAXSERVE_INIT_TIMEOUT_S": value}
    if isinstance(expected, int):
        assert init_timeout_s(env) == expected
    else:
        with pytest.raises(ValueError, match=f"JAXSERVE_INIT_TIMEOUT_S.*{expected}"):
            init_timeout_s(env)
