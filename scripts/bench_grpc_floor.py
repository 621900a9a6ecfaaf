"""The floor of a streamed gRPC call on this machine: bare grpc.aio, no jaxserve code.

A server process (grpc.aio on uvloop, as jaxserve's frontend) answers a unary-stream
method with `--messages` small messages; a client in this process calls it `--calls`
times one after another. Prints per call the wall ms and the server's CPU ms (its
/proc/PID/stat utime + stime), for each message count given, with `uptime`. What the
frontend's CPU per request and per stream message (scripts/bench_serve.py's CPU us/token
columns) compares against: the part of it that is gRPC's own.

    python scripts/bench_grpc_floor.py [--calls 300] [--messages 1,4,16]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import subprocess
import time

import grpc

METHOD = "/floor.Floor/Stream"


def _serve(port_queue, num_messages: int) -> None:
    import uvloop

    async def stream(request, context):
        for _ in range(num_messages):
            yield b"x" * 24  # about one GenerateResponse of a few tokens

    async def main():
        server = grpc.aio.server()
        handler = grpc.unary_stream_rpc_method_handler(stream)
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("floor.Floor", {"Stream": handler}),)
        )
        port_queue.put(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        await server.wait_for_termination()

    uvloop.run(main())


def _cpu_s(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _measure(port: int, pid: int, calls: int) -> tuple[float, float]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.unary_stream(METHOD)
        for _ in range(20):  # warm-up
            async for _ in call(b"hi"):
                pass
        cpu, start = _cpu_s(pid), time.perf_counter()
        for _ in range(calls):
            async for _ in call(b"hi"):
                pass
        return (time.perf_counter() - start) / calls, (_cpu_s(pid) - cpu) / calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--messages", default="1,4,16", help="messages per call, comma-separated")
    args = ap.parse_args()
    counts = [int(m) for m in args.messages.split(",")]
    if args.calls < 1 or min(counts) < 1:
        ap.error("--calls and every --messages value must be >= 1")
    print("# " + subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
    print(f"{'messages/call':>13} {'wall ms/call':>13} {'server CPU ms/call':>19}")
    for n in counts:
        queue = mp.Queue()
        proc = mp.Process(target=_serve, args=(queue, n), daemon=True)
        proc.start()
        try:
            wall, cpu = asyncio.run(_measure(queue.get(timeout=60), proc.pid, args.calls))
        finally:
            proc.kill()
        print(f"{n:>13} {1e3 * wall:>13.2f} {1e3 * cpu:>19.2f}", flush=True)
    print("# " + subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())


if __name__ == "__main__":
    main()
