"""Memory maps of a JAX process against Linux's `vm.max_map_count` (scripts/test.sh says why).

    python scripts/map_count.py --pid PID [--interval 15]   # follow a process until it exits
    python scripts/map_count.py --compile 400               # maps per executable, here

`--pid` prints the process's map count (/proc/PID/maps lines), threads, RSS and the load
average every `--interval` seconds, then the peak: how a full test run was measured
(pgrep -f "python -m pytest" for the PID). `--compile N` compiles N distinct small
executables in this process, keeping each alive, and prints the map count every 50 and the
maps per executable. Run as root with the limit lowered (`echo 4000 >
/proc/sys/vm/max_map_count`, then restore it) to see what XLA's CPU runtime does at the
limit: "LLVM compilation error: Cannot allocate memory", then a segmentation fault.
"""

from __future__ import annotations

import argparse
import os
import time


def map_count(pid: int | str = "self") -> int:
    """Lines of /proc/PID/maps: the process's memory maps. Raises OSError if it is gone."""
    with open(f"/proc/{pid}/maps") as f:
        return sum(1 for _ in f)


def follow(pid: int, interval: float) -> None:
    peak = 0
    limit = open("/proc/sys/vm/max_map_count").read().strip()
    print(f"vm.max_map_count {limit}")
    while True:
        try:
            maps = map_count(pid)
            threads = len(os.listdir(f"/proc/{pid}/task"))
            rss = next(ln for ln in open(f"/proc/{pid}/status") if ln.startswith("VmRSS"))
        except (OSError, StopIteration):
            break
        peak = max(peak, maps)
        load = os.getloadavg()[0]
        print(f"{time.strftime('%T')} maps={maps} threads={threads} "
              f"rss={rss.split()[1]} kB load={load:.2f}", flush=True)  # fmt: skip
        time.sleep(interval)
    print(f"process {pid} gone; peak maps {peak} (limit {limit})")


def compile_many(count: int) -> None:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import jax.numpy as jnp

    keep = []
    start = map_count()
    for i in range(count):
        f = jax.jit(lambda x, i=i: jnp.tanh(x @ x.T + i).sum(0) * jnp.sin(x).mean())
        keep.append(f.lower(jnp.ones((8 + i % 64, 16 + i // 64))).compile())
        if i % 50 == 0:
            print(f"{i} executables: {map_count()} maps", flush=True)
    per = (map_count() - start) / max(1, count)
    print(f"{count} executables: {map_count()} maps, {per:.1f} per executable")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--pid", type=int, help="follow this process until it exits")
    group.add_argument("--compile", type=int, help="compile this many executables here")
    parser.add_argument("--interval", type=float, default=15.0, help="seconds (--pid)")
    args = parser.parse_args()
    if args.pid is not None:
        follow(args.pid, args.interval)
    else:
        compile_many(args.compile)


if __name__ == "__main__":
    main()
