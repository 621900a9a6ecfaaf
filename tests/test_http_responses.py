"""`responses._until_disconnect`: a response whose send fails because its client is gone
is a DEBUG line, any other failure an ERROR with its traceback. A fresh-user trial sent
three pipelined requests on one connection, read 50 bytes and closed it: each time the
log got `ERROR response failed` with uvloop's RuntimeError from the closed transport."""

from __future__ import annotations

import asyncio

import pytest

from jaxserve.frontend.http import responses


async def _never_disconnects():
    await asyncio.Event().wait()


def _run(error: BaseException, monkeypatch) -> dict[str, list[str]]:
    logged: dict[str, list[str]] = {"error": [], "debug": []}
    monkeypatch.setattr(responses.logger, "error", lambda msg, *a, **k: logged["error"].append(msg))
    monkeypatch.setattr(responses.logger, "debug", lambda msg, *a, **k: logged["debug"].append(msg))
    closed = []

    async def work():
        raise error

    asyncio.run(responses._until_disconnect(work(), _never_disconnects, lambda: closed.append(1)))
    assert closed == [1]  # on_close runs however the response ended
    return logged


@pytest.mark.parametrize(
    "error",
    [
        RuntimeError("unable to perform operation on <TCPTransport closed=True reading=False>"),
        ConnectionResetError("Connection lost"),
    ],
)
def test_a_send_to_a_client_that_is_gone_is_a_debug_line(error, monkeypatch):
    logged = _run(error, monkeypatch)
    assert logged["error"] == []
    assert logged["debug"] == ["response not sent: the client is gone (%s)"]


@pytest.mark.parametrize("error", [RuntimeError("some bug"), ValueError("another")])
def test_another_failure_is_an_error_with_its_traceback(error, monkeypatch):
    logged = _run(error, monkeypatch)
    assert logged["error"] == ["response failed"]
