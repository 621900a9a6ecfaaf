"""Expert-parallel MoE benchmarks on emulated CPU devices; prints tables.

    .venv/bin/python scripts/bench_ep.py                 # every part
    .venv/bin/python scripts/bench_ep.py --part moe      # MoE layer vs number of devices
    .venv/bin/python scripts/bench_ep.py --part dispatch --tokens 64 512 2048
    .venv/bin/python scripts/bench_ep.py --part coordination
    .venv/bin/python scripts/bench_ep.py --simulate       # analytical dispatch bytes only

(The step agreement latency at 2 / 4 / 8 processes: scripts/bench_step_agreement.py.)

Part "moe": one MoE layer (both paths of `jaxserve.sharding.moe_ep`) on a mesh of
dp = D emulated CPU devices, D = 1..8, at a decode-sized and a prefill-sized step:
median time per call and the bytes each device sends per step (all_to_all path: the
static dispatch + combine buffers, capacity padding included; replicated path: ring
all_gather + reduce-scatter volumes). E logical experts live on S = ceil(E / D) * D
physical slots, the extra slots holding replicas (as EPLB would). On the CPU the
"devices" share the host's cores and memory, so the times show the cost of the extra
work and copies, not of a network.

Part "dispatch": one MoE layer on 8 emulated CPU devices (dp = 8), the all_to_all path
with worst-case buffers ("old", capacity_factor=None) and routing-sized ("new",
--capacity-factor), calls interleaved, random and Zipf-skewed routing: median ms and the
bytes per device (`moe_ep.all_to_all_bytes_per_device` with the step's overflow rounds,
counted on the host from the routing as the step's pmax sees it); JSON in
bench_results/ep_dispatch.json.

Part "coordination": the per-step agreement between processes. A step loop like the
engine's (build the step's host inputs, publish them on the step channel, run one MoE
layer that depends on them, fetch a small replicated output) runs with 1 process x 8
devices and with 2 processes x 4 devices (jax.distributed on loopback); reported per
step: the leader's publish time, the follower's transit time (leader send -> follower
has the arrays) and the whole step time.

--simulate (no devices, nothing timed): bytes one device sends per MoE layer step
(dispatch rows with their int32 expert ids, then the results back; its own rows stay
local) for Qwen3-30B-A3B (H = 2048, 128 experts, top-8) at ep 8/16/32/64 and DeepSeek-V3
(H = 7168, 256 routed experts, top-8) at ep 32/64/128/256, bf16, 16/256/4096 tokens per
device, three ways:

- today: the static worst-case buffers of the all_to_all path, (ep - 1) x tokens x
  min(top_k, slots per device) rows (`sharding.moe_ep.all_to_all_bytes_per_device`);
- ideal: the rows really routed off-device in the step;
- new: the routing-sized dispatch the step runs (`sharding.dispatch_capacity`): a main
  round of ceil(capacity_factor x mean) rows per peer and drop-free overflow rounds of
  a quarter of that, as many as the step's busiest (device, peer) pair needs (the same
  count on every device); sizes and bytes from the functions the dispatch itself uses.

Routing: each layer's expert popularity is Zipf (1 / rank^s, --sim-zipf, default 1.0);
a step's rows from one device to each peer are multinomial over the devices' shares of
the load (a token's top-k choices drawn independently; a choice picks one copy of its
expert evenly). "eplb": the placement `plan_placement` makes from the popularity, S = E
+ ep slots; "zipf": the checkpoint placement (expert e on device e // (E / ep), S = E),
no EPLB. Mean over --sim-steps steps. (On a GPU the ragged dispatch,
`sharding.moe_ragged`, sends about the ideal: `dispatch_capacity.ragged_bytes_per_device`.)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from jaxserve.sharding.dispatch_capacity import DEFAULT_CAPACITY_FACTOR

HIDDEN, INTERMEDIATE, NUM_EXPERTS, TOP_K = 512, 256, 16, 2
# A step's host inputs as the engine packs them (one definition, with the step-agreement
# benchmark's; scripts/ is on sys.path when a script runs).
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_step_agreement import STEP_ROWS, STEP_TOKENS, _step_host_inputs  # noqa: E402


def _setup_cpu(num_devices: int) -> None:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={num_devices}")


# ----- part 1: MoE layer vs number of devices ---------------------------------------------


def bench_moe(token_counts: list[int], repeats: int) -> list[dict]:
    _setup_cpu(8)
    import jax
    import numpy as np

    from jaxserve.sharding import moe_ep
    from jaxserve.sharding.mesh import build_mesh
    from jaxserve.sharding.placement import placement_from_slots
    from jaxserve.sharding.rules import batch_sharding, named_sharding, replicated

    rng = np.random.default_rng(0)
    scale = 1 / math.sqrt(HIDDEN)
    logical = {
        "w_gate": rng.standard_normal((NUM_EXPERTS, HIDDEN, INTERMEDIATE)) * scale,
        "w_up": rng.standard_normal((NUM_EXPERTS, HIDDEN, INTERMEDIATE)) * scale,
        "w_down": rng.standard_normal((NUM_EXPERTS, INTERMEDIATE, HIDDEN)) * scale,
    }
    rows = []
    for devices in range(1, 9):
        mesh = build_mesh(devices, 1, jax.devices()[:devices])
        slots = math.ceil(NUM_EXPERTS / devices) * devices
        placement = placement_from_slots(np.arange(slots) % NUM_EXPERTS, NUM_EXPERTS, 2)
        experts = named_sharding(mesh, ("experts", None, None))
        p2l = np.asarray(placement.physical_to_logical)
        weights = [
            jax.device_put(logical[n][p2l].astype(np.float32), experts)
            for n in ("w_gate", "w_up", "w_down")
        ]
        tables = jax.device_put(placement, replicated(mesh))
        for wanted in token_counts:
            num_tokens = math.ceil(wanted / devices) * devices
            x = rng.standard_normal((num_tokens, HIDDEN)).astype(np.float32)
            ids = np.stack([rng.choice(NUM_EXPERTS, TOP_K, replace=False) for _ in x])
            w = np.full((num_tokens, TOP_K), 1 / TOP_K, np.float32)
            args = [
                jax.device_put(a, batch_sharding(mesh, 2)) for a in (x, w, ids.astype(np.int32))
            ]
            row = {"devices": devices, "slots": slots, "tokens": num_tokens}
            for path in (moe_ep.ALL_TO_ALL, moe_ep.REPLICATED):
                fn = jax.jit(
                    lambda *a, p=path, m=mesh: moe_ep.expert_parallel_moe(*a, mesh=m, path=p)
                )
                fn(*args, *weights, tables).block_until_ready()
                times = []
                for _ in range(repeats):
                    start = time.perf_counter()
                    fn(*args, *weights, tables).block_until_ready()
                    times.append(time.perf_counter() - start)
                row[f"{path}_ms"] = 1e3 * statistics.median(times)
            row["all_to_all_kib"] = (
                moe_ep.all_to_all_bytes_per_device(num_tokens, HIDDEN, TOP_K, mesh, slots, 4) / 1024
            )
            row["replicated_kib"] = (
                moe_ep.replicated_bytes_per_device(num_tokens, HIDDEN, TOP_K, mesh, 4) / 1024
            )
            rows.append(row)
            print(
                f"D={devices} T={num_tokens:4d} S={slots:2d}  "
                f"all_to_all {row['all_to_all_ms']:8.2f} ms {row['all_to_all_kib']:9.1f} KiB/dev   "
                f"replicated {row['replicated_ms']:8.2f} ms {row['replicated_kib']:9.1f} KiB/dev",
                flush=True,
            )
    return rows


# ----- part "dispatch": worst-case vs routing-sized all_to_all on 8 devices -------------


def step_overflow_rounds(ids, placement, ep: int, cap) -> int:
    """The overflow rounds the dispatch runs for this routing (dp = ep, tp = 1): the
    largest (device, peer) row count over `cap.main`, as the step's pmax sees it.

    ids: [T, k] logical experts of the flat batch; placement: NumPy tables."""
    import numpy as np

    token = np.arange(ids.shape[0])[:, None]
    slots = placement.logical_to_physical[ids, token % placement.replica_counts[ids]]
    per_device = slots.shape[0] // ep
    dest = slots.reshape(ep, per_device * ids.shape[1]) // (placement.num_slots // ep)
    counts = np.stack([np.bincount(d, minlength=ep) for d in dest])
    return cap.overflow_rounds(int(counts.max()) - cap.main)


def bench_dispatch(token_counts: list[int], repeats: int, factor: float) -> list[dict]:
    """One MoE layer on 8 emulated CPU devices (dp = 8), the all_to_all path with
    worst-case buffers ("old") and routing-sized ("new"), calls interleaved; random
    (near-balanced) and Zipf-1.0-skewed routing over 2 slots per device."""
    _setup_cpu(8)
    import jax
    import numpy as np

    from jaxserve.sharding import moe_ep
    from jaxserve.sharding.dispatch_capacity import dispatch_capacity
    from jaxserve.sharding.mesh import build_mesh
    from jaxserve.sharding.placement import identity_placement
    from jaxserve.sharding.rules import batch_sharding, named_sharding, replicated

    ep = 8
    mesh = build_mesh(ep, 1)
    rng = np.random.default_rng(0)
    scale = 1 / math.sqrt(HIDDEN)
    experts = named_sharding(mesh, ("experts", None, None))
    shapes = [(NUM_EXPERTS, HIDDEN, INTERMEDIATE)] * 2 + [(NUM_EXPERTS, INTERMEDIATE, HIDDEN)]
    weights = [
        jax.device_put((rng.standard_normal(s) * scale).astype(np.float32), experts) for s in shapes
    ]
    placement = identity_placement(NUM_EXPERTS)
    tables = jax.device_put(placement, replicated(mesh))
    fns = {
        name: jax.jit(lambda *a, f=f: moe_ep.expert_parallel_moe(*a, mesh=mesh, capacity_factor=f))
        for name, f in (("old", None), ("new", factor))
    }
    zipf = 1.0 / np.arange(1, NUM_EXPERTS + 1)
    rows = []
    for num_tokens in token_counts:
        for routing in ("random", "zipf"):
            p = None if routing == "random" else rng.permutation(zipf / zipf.sum())
            ids = np.stack(
                [rng.choice(NUM_EXPERTS, TOP_K, replace=False, p=p) for _ in range(num_tokens)]
            ).astype(np.int32)
            x = rng.standard_normal((num_tokens, HIDDEN)).astype(np.float32)
            w = np.full((num_tokens, TOP_K), 1 / TOP_K, np.float32)
            args = [jax.device_put(a, batch_sharding(mesh, 2)) for a in (x, w, ids)]
            times: dict[str, list[float]] = {"old": [], "new": []}
            outs = {n: fn(*args, *weights, tables).block_until_ready() for n, fn in fns.items()}
            assert np.allclose(outs["old"], outs["new"], atol=1e-5), "old and new differ"
            for _ in range(repeats):
                for name, fn in fns.items():
                    start = time.perf_counter()
                    fn(*args, *weights, tables).block_until_ready()
                    times[name].append(time.perf_counter() - start)
            cap = dispatch_capacity(num_tokens // ep, TOP_K, ep, NUM_EXPERTS // ep, factor)
            rounds = step_overflow_rounds(ids, placement, ep, cap)
            row = {
                "tokens": num_tokens,
                "routing": routing,
                "old_ms": 1e3 * statistics.median(times["old"]),
                "new_ms": 1e3 * statistics.median(times["new"]),
                "old_kib": moe_ep.all_to_all_bytes_per_device(
                    num_tokens, HIDDEN, TOP_K, mesh, NUM_EXPERTS, 4
                )
                / 1024,
                "new_kib": moe_ep.all_to_all_bytes_per_device(
                    num_tokens, HIDDEN, TOP_K, mesh, NUM_EXPERTS, 4, factor, rounds
                )
                / 1024,
                "overflow_rounds": rounds,
            }
            rows.append(row)
            print(row, flush=True)
    return rows


def print_dispatch(rows: list[dict]) -> None:
    print("\n| tokens | routing | old ms | new ms | old KiB/dev | new KiB/dev | overflow rounds |")
    print("|---" * 7 + "|")
    for r in rows:
        print(
            f"| {r['tokens']} | {r['routing']} | {r['old_ms']:.2f} | {r['new_ms']:.2f} "
            f"| {r['old_kib']:.1f} | {r['new_kib']:.1f} | {r['overflow_rounds']} |"
        )


# ----- --simulate: analytical bytes per device per MoE layer step ------------------------

# (name, hidden, experts, top_k, ep values): the models' Hugging Face configs.
SIM_MODELS = [
    ("Qwen3-30B-A3B", 2048, 128, 8, (8, 16, 32, 64)),
    ("DeepSeek-V3", 7168, 256, 8, (32, 64, 128, 256)),
]
SIM_TOKENS = (16, 256, 4096)
BF16 = 2


def _device_shares(popularity, placement: str, num_experts: int, ep: int):
    """[ep] share of the routed rows each device receives, and the slots per layer."""
    import numpy as np

    from jaxserve.eplb.planner import device_load, plan_placement

    if placement == "zipf":
        slots = num_experts
        load = device_load(popularity, np.arange(num_experts), ep)
    else:
        slots = num_experts + ep
        load = plan_placement(popularity[None] * 1e9, slots, ep).device_load[0]
    return load / load.sum(), slots


def simulate(zipf: float, steps: int, factor: float) -> list[dict]:
    import numpy as np

    from jaxserve.sharding.dispatch_capacity import (
        dispatch_bytes_per_device,
        dispatch_capacity,
        ideal_bytes_per_device,
    )

    rng = np.random.default_rng(0)
    rows = []
    for name, hidden, num_experts, top_k, eps in SIM_MODELS:
        weight = 1.0 / np.arange(1, num_experts + 1) ** zipf
        popularity = rng.permutation(weight / weight.sum())
        for ep in eps:
            for placement in ("eplb", "zipf"):
                share, slots = _device_shares(popularity, placement, num_experts, ep)
                for tokens in SIM_TOKENS:
                    # The same sizes and byte counts as the compiled dispatch uses.
                    old = dispatch_capacity(tokens, top_k, ep, slots // ep, None)
                    new = dispatch_capacity(tokens, top_k, ep, slots // ep, factor)
                    ideal, sent_new, rounds = [], [], []
                    for _ in range(steps):
                        # sent[i, j]: rows device i routes to device j this step.
                        sent = rng.multinomial(tokens * top_k, share, size=ep)
                        off = sent.sum(1) - np.diag(sent)
                        ideal.append(ideal_bytes_per_device(off.mean(), hidden, BF16))
                        # The dispatch's pmax: the largest excess of any (device, peer)
                        # pair, a device's rows to itself included (they use the buffer).
                        # (Independent draws can exceed what distinct top-k experts
                        # allow, tokens x min(k, slots per device): clamped.)
                        r = new.overflow_rounds(min(int(sent.max()), new.worst) - new.main)
                        rounds.append(r)
                        sent_new.append(dispatch_bytes_per_device(new, hidden, BF16, r))
                    row = {
                        "model": name,
                        "ep": ep,
                        "routing": placement,
                        "slots": slots,
                        "tokens_per_device": tokens,
                        "capacity_factor": factor,
                        "today_bytes": dispatch_bytes_per_device(old, hidden, BF16),
                        "ideal_bytes": statistics.mean(ideal),
                        "new_bytes": statistics.mean(sent_new),
                        "main_rows_per_peer": new.main,
                        "overflow_rows_per_round": new.overflow,
                        "overflow_steps": sum(r > 0 for r in rounds) / steps,
                        "mean_overflow_rounds": statistics.mean(rounds),
                        "max_device_share_x_ep": float(share.max() * ep),
                    }
                    rows.append(row)
    return rows


def print_simulation(rows: list[dict]) -> None:
    print(
        "\n| model | ep | routing | tokens/dev | today MiB | ideal MiB | new MiB "
        "| today/ideal | new/ideal | main rows/peer | overflow steps | rounds/step "
        "| busiest device x mean |"
    )
    print("|---" * 13 + "|")
    for r in rows:
        mib = [r[k] / 2**20 for k in ("today_bytes", "ideal_bytes", "new_bytes")]
        print(
            f"| {r['model']} | {r['ep']} | {r['routing']} | {r['tokens_per_device']} "
            f"| {mib[0]:.3f} | {mib[1]:.3f} | {mib[2]:.3f} | {mib[0] / mib[1]:.1f}x "
            f"| {mib[2] / mib[1]:.2f}x | {r['main_rows_per_peer']} "
            f"| {r['overflow_steps']:.0%} | {r['mean_overflow_rounds']:.2f} "
            f"| {r['max_device_share_x_ep']:.2f} |"
        )


# ----- part 2: per-step coordination, 1 process vs 2 --------------------------------------


def coordination_worker(steps: int, out: str) -> None:
    """One process of the coordination benchmark (env: JAX_* as set by the launcher)."""
    from jaxserve import distributed

    config = distributed.resolve()
    distributed.initialize(config)
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxserve.distributed.step_channel import StepPublisher, StepSubscriber
    from jaxserve.distributed.step_message import STOP
    from jaxserve.sharding import moe_ep
    from jaxserve.sharding.mesh import build_mesh
    from jaxserve.sharding.placement import identity_placement
    from jaxserve.sharding.rules import batch_sharding, named_sharding, replicated

    mesh = build_mesh(2, 4)
    rng = np.random.default_rng(0)
    experts = named_sharding(mesh, ("experts", None, None))
    weights = [
        jax.device_put((rng.standard_normal(s) / math.sqrt(HIDDEN)).astype(np.float32), experts)
        for s in [(NUM_EXPERTS, HIDDEN, INTERMEDIATE)] * 2 + [(NUM_EXPERTS, INTERMEDIATE, HIDDEN)]
    ]
    x = jax.device_put(
        rng.standard_normal((STEP_TOKENS, HIDDEN)).astype(np.float32), batch_sharding(mesh, 2)
    )
    tables = jax.device_put(identity_placement(NUM_EXPERTS), replicated(mesh))

    @jax.jit
    def step(tokens, x, w_gate, w_up, w_down, tables):
        ids = (tokens[:, None] + jnp.arange(TOP_K)) % NUM_EXPERTS
        w = jnp.full(ids.shape, 1.0 / TOP_K, x.dtype)
        y = moe_ep.expert_parallel_moe(x, w, ids, w_gate, w_up, w_down, tables, mesh=mesh)
        return jax.lax.with_sharding_constraint(jnp.sum(y, axis=1), replicated(mesh))

    def run(arrays):
        tokens = jax.device_put(arrays[0], batch_sharding(mesh, 1))
        out = step(tokens, x, *weights, tables)
        return np.asarray(out.addressable_data(0))

    leader = config is None or config.is_leader
    port = (
        None if config is None else config.coordinator_port + distributed.STEP_CHANNEL_PORT_OFFSET
    )
    result: dict = {}
    if leader:
        channel = None
        if config is not None:
            channel = StepPublisher(config.coordinator_host, port, config.num_processes - 1)
        step_times = []
        for i in range(steps + 5):  # 5 warm-up steps
            start = time.perf_counter()
            arrays = _step_host_inputs(i)
            if channel is not None:
                channel.publish(arrays, meta={"bucket": [STEP_TOKENS, STEP_ROWS]})
            run(arrays)
            if i >= 5:
                step_times.append(time.perf_counter() - start)
        result["step_us"] = 1e6 * statistics.median(step_times)
        if channel is not None:
            samples = channel.stats.samples_s[5:]
            result["publish_us"] = 1e6 * statistics.median(samples)
            channel.close()
    else:
        channel = StepSubscriber(config.coordinator_host, port, config.process_id)
        while (message := channel.receive(timeout_s=300)).kind != STOP:
            run(message.arrays)
        result["transit_us"] = 1e6 * statistics.median(channel.stats.samples_s[5:])
        channel.close()
    Path(out).with_suffix(f".{0 if config is None else config.process_id}.json").write_text(
        json.dumps(result)
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bench_coordination(steps: int) -> dict[int, dict]:
    results = {}
    root = Path(__file__).resolve().parents[1]
    for num_processes in (1, 2):
        with tempfile.TemporaryDirectory() as tmp:
            out = str(Path(tmp) / "result")
            port = _free_port()
            env = dict(os.environ)
            env.update(
                JAX_PLATFORMS="cpu",
                XLA_FLAGS=f"--xla_force_host_platform_device_count={8 // num_processes}",
                PYTHONPATH=str(root),
            )
            if num_processes > 1:
                env.update(
                    JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                    JAX_NUM_PROCESSES=str(num_processes),
                )
            cmd = [sys.executable, __file__, "--worker", "--steps", str(steps), "--out", out]
            procs = [
                subprocess.Popen(cmd, env={**env, "JAX_PROCESS_ID": str(i)})
                for i in range(num_processes)
            ]
            for p in procs:
                if p.wait(timeout=600) != 0:
                    raise RuntimeError(f"coordination worker failed with {p.returncode}")
            merged = {}
            for i in range(num_processes):
                merged.update(json.loads(Path(f"{out}.{i}.json").read_text()))
            results[num_processes] = merged
            print(f"{num_processes} process(es): {merged}", flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--part",
        choices=["moe", "dispatch", "coordination", "all"],
        default="all",
    )
    parser.add_argument("--tokens", type=int, nargs="+", default=[16, 256])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--simulate", action="store_true", help="analytical bytes only")
    parser.add_argument("--sim-zipf", type=float, default=1.0)
    parser.add_argument("--sim-steps", type=int, default=20)
    parser.add_argument(
        "--capacity-factor",
        type=float,
        default=DEFAULT_CAPACITY_FACTOR,
        help="main round over the mean rows per peer (sharding.dispatch_capacity)",
    )
    parser.add_argument("--json", default="bench_results/ep_simulate.json")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        coordination_worker(args.steps, args.out)
        return
    if args.simulate:
        _setup_cpu(1)
        uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
        print(f"uptime: {uptime}")
        rows = simulate(args.sim_zipf, args.sim_steps, args.capacity_factor)
        print_simulation(rows)
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(
            json.dumps({"zipf": args.sim_zipf, "uptime": uptime, "rows": rows}, indent=1)
        )
        print(f"wrote {path}")
        return
    if args.part in ("moe", "all"):
        rows = bench_moe(args.tokens, args.repeats)
        print("\n| D | tokens | slots | all_to_all ms | KiB/dev | replicated ms | KiB/dev |")
        print("|---|---|---|---|---|---|---|")
        for r in rows:
            cells = [r["devices"], r["tokens"], r["slots"], f"{r['all_to_all_ms']:.2f}"]
            cells += [f"{r['all_to_all_kib']:.1f}", f"{r['replicated_ms']:.2f}"]
            cells += [f"{r['replicated_kib']:.1f}"]
            print("| " + " | ".join(map(str, cells)) + " |")
    if args.part in ("dispatch", "all"):
        uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
        print(f"uptime: {uptime}")
        rows = bench_dispatch(args.tokens, args.repeats, args.capacity_factor)
        print_dispatch(rows)
        path = Path("bench_results/ep_dispatch.json")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"uptime": uptime, "rows": rows}, indent=1))
        print(f"wrote {path}")
    if args.part in ("coordination", "all"):
        res = bench_coordination(args.steps)
        print("\n| processes x devices | step us | leader publish us | follower transit us |")
        print("|---|---|---|---|")
        for n, r in res.items():
            cells = [f"{n} x {8 // n}", f"{r['step_us']:.0f}"]
            cells += [f"{r.get('publish_us', 0):.1f}", f"{r.get('transit_us', 0):.1f}"]
            print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
