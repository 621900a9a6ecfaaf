"""EPLB planner benchmark: the project's planner beside DeepSeek's EPLB as published.

    .venv/bin/python scripts/bench_eplb.py [--zipf 0.4 0.6 0.8 1.0] [--json PATH]

The workload (defaults: DeepSeek-V3 at wide EP): E = 256 routed experts, 61 MoE layers,
64 devices in 8 nodes, S = 320 slots (64 redundant), top-8 routing, 8192 tokens per
step (128 per device). Each layer's expert popularity follows Zipf's law (the expert of
rank r gets weight 1 / r^s, ranks shuffled per layer). The plan is made from a window of
--window steps (token counts drawn from the popularity); it is then judged on the
steps that follow, each drawn afresh: every expert's step count is multinomial over
the experts, and each slot of that expert gets a Poisson share (mean count / copies:
a token picks one of its expert's copies by its index, `sharding.placement.choose_slots`,
which spreads them like a random pick).

Per Zipf exponent and policy (global; hierarchical: 8 groups of 32 experts, one node's
devices per group, DeepSeek-V3's group-limited routing), for `deepseek`
(`plan_placement(..., refine=False)`: DeepSeek's algorithm as published, the project's
additions off) and `planner` (the default), in the same run:

- balance: balancedness (mean / max device load; 1.0 = balanced), mean over layers, of
  the planning window, of each next step (mean over --steps steps, with its standard
  error; and again with each expert's step count split evenly over its copies, which
  shows the placement without the per-copy sampling noise), and of 10 and of 50
  consecutive steps summed (mean over the --steps / 10 and --steps / 50 such windows,
  with standard errors: the next 10 and 50 steps after a plan, repeated);
- dup: (device, expert) pairs holding a second copy, over all layers; over-cap: experts
  with more copies than devices (hierarchical: than their node's devices);
- plan ms: CPU time (`time.process_time`, one core) of planning all layers, median of
  --repeats;
- churn: the next window of the same popularity (unchanged load, sampling noise only)
  and of a new popularity for every layer (shifted load). deepseek replans fresh:
  slots changed as installed, and after `minimize_movement` (the controller's
  reorder); planner replans with `current` and --tolerance: slots changed (mean and max
  over layers), the worst balancedness gap to its own fresh plan of that window, and its
  CPU time.

Prints a table and writes JSON (--json, default bench_results/eplb_planner.json); the
machine load (`uptime`) is printed with the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time
from pathlib import Path

import numpy as np

from jaxserve.eplb.planner import device_load, minimize_movement, plan_placement
from jaxserve.eplb.recorder import balancedness


def zipf_popularity(rng: np.random.Generator, layers: int, experts: int, s: float) -> np.ndarray:
    """[L, E] routing probabilities: Zipf weights 1 / rank^s, ranks shuffled per layer."""
    weight = 1.0 / np.arange(1, experts + 1) ** s
    return np.stack([rng.permutation(weight / weight.sum()) for _ in range(layers)])


def window_load(rng: np.random.Generator, popularity: np.ndarray, routings: int) -> np.ndarray:
    """[L, E] token counts of `routings` (token, choice) pairs per layer."""
    return np.stack([rng.multinomial(routings, p) for p in popularity]).astype(np.float64)


def step_device_loads(
    rng: np.random.Generator, expert_counts: np.ndarray, p2l: np.ndarray, ep: int
) -> np.ndarray:
    """[T, L, ep] device loads of T steps: expert_counts [T, L, E] split over each
    expert's copies (Poisson share of count / copies per slot)."""
    layers, slots = p2l.shape
    counts = np.stack([np.bincount(row, minlength=expert_counts.shape[-1]) for row in p2l])
    per_copy = np.take_along_axis(
        expert_counts / counts, np.broadcast_to(p2l, (len(expert_counts), layers, slots)), 2
    )
    slot_load = rng.poisson(per_copy).astype(np.float64)
    return slot_load.reshape(len(expert_counts), layers, ep, -1).sum(-1)


def _stderr(values: np.ndarray) -> float:
    """Standard error of the mean of independent samples."""
    return float(values.std() / np.sqrt(values.size))


def duplicates(p2l: np.ndarray, ep: int) -> int:
    per_device = np.sort(p2l.reshape(p2l.shape[0], ep, -1), axis=-1)
    return int((per_device[..., 1:] == per_device[..., :-1]).sum())


def over_cap(p2l: np.ndarray, num_experts: int, cap: int) -> int:
    return int(sum((np.bincount(row, minlength=num_experts) > cap).sum() for row in p2l))


def timed(fn, repeats: int) -> tuple[object, float]:
    """(result, median CPU ms of `repeats` calls)."""
    times, result = [], None
    for _ in range(repeats):
        start = time.process_time()
        result = fn()
        times.append(1e3 * (time.process_time() - start))
    return result, statistics.median(times)


def moved(current: np.ndarray, planned: np.ndarray) -> np.ndarray:
    """[L] fraction of slots whose expert changes."""
    return (current != planned).mean(1)


def bench_case(args, rng: np.random.Generator, s: float, hierarchical: bool) -> dict:
    layers, experts, slots, ep = args.layers, args.experts, args.slots, args.ep
    kwargs = {"num_nodes": args.nodes, "num_groups": args.groups} if hierarchical else {}
    nodes = args.nodes if hierarchical else 1
    routings = args.tokens * args.top_k
    popularity = zipf_popularity(rng, layers, experts, s)
    window = window_load(rng, popularity, routings * args.window)
    steps = np.stack([window_load(rng, popularity, routings) for _ in range(args.steps)])
    next_window = window_load(rng, popularity, routings * args.window)
    shifted = window_load(rng, zipf_popularity(rng, layers, experts, s), routings * args.window)
    seed = int(rng.integers(2**31))
    out = {"zipf": s, "policy": "hierarchical" if hierarchical else "global"}
    plans = {}
    for name, refine in (("deepseek", False), ("planner", True)):
        plan, ms = timed(
            lambda r=refine: plan_placement(window, slots, ep, refine=r, **kwargs), args.repeats
        )
        p2l = plan.physical_to_logical
        plans[name] = p2l
        # The same step noise for both planners (same seed).
        loads = step_device_loads(np.random.default_rng(seed), steps, p2l, ep)
        per_step = balancedness(loads)  # [T, L]
        even = device_load(steps, np.broadcast_to(p2l, steps.shape[:2] + p2l.shape[1:]), ep)
        row = {
            "window": float(balancedness(plan.device_load).mean()),
            "step": float(per_step.mean()),
            "step_stderr": _stderr(per_step),
            # The same steps with each expert's count split evenly over its copies: the
            # placement's effect without the per-copy sampling noise.
            "step_even_split": float(balancedness(even).mean()),
        }
        for span in (10, 50):
            # Consecutive windows of `span` steps, each summed: mean and standard error.
            sums = loads[: len(loads) // span * span].reshape(-1, span, *loads.shape[1:])
            per_window = balancedness(sums.sum(1))  # [W, L]
            row[f"next_{span}"] = float(per_window.mean())
            row[f"next_{span}_stderr"] = _stderr(per_window.mean(1))
        row |= {
            "duplicates": duplicates(p2l, ep),
            "over_cap": over_cap(p2l, experts, ep // nodes),
            "plan_ms": ms,
        }
        for label, load in (("unchanged", next_window), ("shifted", shifted)):
            if name == "deepseek":
                fresh = plan_placement(load, slots, ep, refine=False, **kwargs).physical_to_logical
                reordered = np.stack(
                    [
                        minimize_movement(c, f, ep, num_nodes=nodes)[0]
                        for c, f in zip(p2l, fresh, strict=True)
                    ]
                )
                row[label] = {
                    "moved_as_installed": float(moved(p2l, fresh).mean()),
                    "moved_minimized": float(moved(p2l, reordered).mean()),
                    "moved_minimized_max": float(moved(p2l, reordered).max()),
                }
                continue
            fresh = plan_placement(load, slots, ep, **kwargs)
            replan, replan_ms = timed(
                lambda ld=load, cur=p2l: plan_placement(
                    ld, slots, ep, current=cur, tolerance=args.tolerance, **kwargs
                ),
                args.repeats,
            )
            gap = 1 - balancedness(replan.device_load) / balancedness(fresh.device_load)
            fresh_moved = np.stack(
                [
                    minimize_movement(c, f, ep, num_nodes=nodes)[0]
                    for c, f in zip(p2l, fresh.physical_to_logical, strict=True)
                ]
            )
            row[label] = {
                "moved": float(moved(p2l, replan.physical_to_logical).mean()),
                "moved_max": float(moved(p2l, replan.physical_to_logical).max()),
                "fresh_moved_minimized": float(moved(p2l, fresh_moved).mean()),
                "gap_to_fresh_max": float(gap.max()),
                "balance": float(balancedness(replan.device_load).mean()),
                "fresh_balance": float(balancedness(fresh.device_load).mean()),
                "duplicates": duplicates(replan.physical_to_logical, ep),
                "replan_ms": replan_ms,
            }
        out[name] = row
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--layers", type=int, default=61)
    parser.add_argument("--ep", type=int, default=64)
    parser.add_argument("--nodes", type=int, default=8)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--slots", type=int, default=320)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per step")
    parser.add_argument("--window", type=int, default=100, help="steps in a planning window")
    parser.add_argument("--steps", type=int, default=400, help="steps judged after the plan")
    parser.add_argument("--zipf", type=float, nargs="+", default=[0.4, 0.6, 0.8, 1.0])
    parser.add_argument("--tolerance", type=float, default=0.005)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default="bench_results/eplb_planner.json")
    args = parser.parse_args()
    uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(f"uptime: {uptime}; cpus: {os.cpu_count()}")
    print(
        f"E={args.experts}, {args.layers} layers, ep={args.ep} ({args.nodes} nodes), "
        f"S={args.slots}, top-{args.top_k}, {args.tokens} tokens/step, window "
        f"{args.window} steps, judged on the next {args.steps}"
    )
    rng = np.random.default_rng(0)
    results = [
        bench_case(args, rng, s, hierarchical) for hierarchical in (False, True) for s in args.zipf
    ]
    header = (
        "| policy | zipf | planner | window | step (±se) | step, even split | next 10 "
        "| next 50 | dup | over-cap "
        "| plan ms | unchanged: moved (max) | gap | shifted: moved (max) | gap | replan ms |"
    )
    print(header)
    print("|---" * (header.count("|") - 1) + "|")
    for r in results:
        for name in ("deepseek", "planner"):
            x = r[name]
            if name == "deepseek":
                churn = [
                    f"{x[k]['moved_as_installed']:.1%} raw, {x[k]['moved_minimized']:.1%} "
                    f"({x[k]['moved_minimized_max']:.0%}) min | -"
                    for k in ("unchanged", "shifted")
                ]
                tail = "-"
            else:
                churn = [
                    f"{x[k]['moved']:.1%} ({x[k]['moved_max']:.0%}) | "
                    f"{x[k]['gap_to_fresh_max']:.2%}"
                    for k in ("unchanged", "shifted")
                ]
                tail = f"{x['unchanged']['replan_ms']:.1f}"
            print(
                f"| {r['policy']} | {r['zipf']} | {name} | {x['window']:.4f} "
                f"| {x['step']:.4f} ± {x['step_stderr']:.4f} | {x['step_even_split']:.4f} "
                f"| {x['next_10']:.4f} ± {x['next_10_stderr']:.4f} "
                f"| {x['next_50']:.4f} ± {x['next_50_stderr']:.4f} | {x['duplicates']} "
                f"| {x['over_cap']} | {x['plan_ms']:.1f} | {churn[0]} | {churn[1]} | {tail} |"
            )
    uptime_after = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(f"uptime after: {uptime_after}")
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        json.dumps(
            {"args": vars(args), "uptime": [uptime, uptime_after], "results": results}, indent=1
        )
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
