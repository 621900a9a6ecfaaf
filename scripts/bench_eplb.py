"""EPLB planner benchmark: balancedness before/after planning on skewed synthetic load.

    .venv/bin/python scripts/bench_eplb.py [--experts 128] [--layers 16] [--zipf 1.0 1.2]

Each layer's expert popularity follows Zipf's law (the expert of rank r gets weight
1 / r^s, ranks shuffled per layer); a window of tokens x top-k routings is drawn from it.
For ep = 8, 16, 32 devices and S = E + ep slots, it prints the balancedness (mean / max
device load, 1.0 = balanced) of:

- static: the checkpoint placement, S = E slots, expert e on device e // (E / ep);
- deepseek: DeepSeek's EPLB greedy (plan_placement(..., refine=False));
- planner: the default plan (greedy + swap refinement);

and the planning time of all layers. Then a second window of the same popularity
(sampling noise only) is balanced three ways: keeping the old plan; a fresh plan (slots
changed when installed as is, and after minimize_movement); and a fresh plan taken per
layer only if it lowers the max device load by more than --min-improvement.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from jaxserve.eplb.planner import device_load, minimize_movement, plan_placement
from jaxserve.eplb.recorder import balancedness


def zipf_window(
    rng: np.random.Generator, popularity: np.ndarray, num_tokens: int, top_k: int
) -> np.ndarray:
    """[L, E] token counts of one window: num_tokens * top_k routings per layer."""
    return np.stack([rng.multinomial(num_tokens * top_k, p) for p in popularity]).astype(float)


def zipf_popularity(rng: np.random.Generator, layers: int, experts: int, s: float) -> np.ndarray:
    weight = 1.0 / np.arange(1, experts + 1) ** s
    return np.stack([rng.permutation(weight / weight.sum()) for _ in range(layers)])


def timed_plan(load: np.ndarray, num_slots: int, ep: int, refine: bool) -> tuple[object, float]:
    start = time.perf_counter()
    plan = plan_placement(load, num_slots, ep, refine=refine)
    return plan, (time.perf_counter() - start) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per window")
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--zipf", type=float, nargs="+", default=[1.0, 1.2])
    parser.add_argument("--ep", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--min-improvement", type=float, default=0.05)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    num_experts = args.experts
    print(
        f"E={num_experts}, {args.layers} layers, {args.tokens} tokens x top-{args.top_k} "
        "per window; balancedness = mean/max device load, averaged over layers"
    )
    header = (
        "| zipf s | ep | S | static | deepseek | planner | plan ms (all layers) "
        "| next window: old plan | replan (moved: as is, minimized) "
        f"| replan unless < {args.min_improvement:.0%} better (moved) |"
    )
    print(header)
    print("|---" * (header.count("|") - 1) + "|")
    for s in args.zipf:
        popularity = zipf_popularity(rng, args.layers, num_experts, s)
        window = zipf_window(rng, popularity, args.tokens, args.top_k)
        next_window = zipf_window(rng, popularity, args.tokens, args.top_k)
        identity = np.tile(np.arange(num_experts), (args.layers, 1))
        for ep in args.ep:
            num_slots = num_experts + ep
            static = balancedness(device_load(window, identity, ep)).mean()
            greedy, _ = timed_plan(window, num_slots, ep, refine=False)
            plan, ms = timed_plan(window, num_slots, ep, refine=True)
            in_use = plan.physical_to_logical
            # The EPLB loop's next step: the load drifts (a new window of the same
            # popularity); keep the old plan, replan fresh, or replan with a threshold.
            old = balancedness(device_load(next_window, in_use, ep)).mean()
            fresh = plan_placement(next_window, num_slots, ep)
            sticky = plan_placement(
                next_window, num_slots, ep, current=in_use, min_improvement=args.min_improvement
            )
            total = args.layers * num_slots
            print(
                f"| {s} | {ep} | {num_slots} | {static:.3f} "
                f"| {balancedness(greedy.device_load).mean():.3f} "
                f"| {balancedness(plan.device_load).mean():.3f} | {ms:.1f} | {old:.3f} "
                f"| {balancedness(fresh.device_load).mean():.3f} "
                f"({int((fresh.physical_to_logical != in_use).sum())}, "
                f"{moved(in_use, fresh.physical_to_logical, ep)} of {total}) "
                f"| {balancedness(sticky.device_load).mean():.3f} "
                f"({moved(in_use, sticky.physical_to_logical, ep)}) |"
            )


def moved(in_use: np.ndarray, planned: np.ndarray, ep: int) -> int:
    """Slots that change expert over all layers after minimize_movement."""
    return sum(minimize_movement(cur, new, ep)[1] for cur, new in zip(in_use, planned, strict=True))


if __name__ == "__main__":
    main()
