"""Async against sync scheduling on one engine, interleaved: does overlapping the host's
packing of step N+1 with the device's step N pay on this machine?

    python scripts/bench_async_ab.py [--models demo,large] [--batches 1,8,32,128]
        [--decode-steps 4] [--repeats 3] [--max-tokens 32] [--out bench_results/async_ab.json]

One `EngineCore` per model (`bench_offline.py`'s demo and random Qwen3-MoE, with its
engine settings); per batch, the two modes alternate on the same engine (switched while
idle, `bench_offline.configure`; the order flips each repeat), each run on fresh prompts
with prefix caching on. Prints the median tok/s of each mode, sync/async and the load
average per row; writes JSON. `SchedulerConfig.async_scheduling` (None: on for an
accelerator, off for the CPU) is what this measures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_offline as bo  # noqa: E402

from jaxserve.config import DEMO_MODEL_DIR, CacheConfig, EngineConfig, SchedulerConfig  # noqa: E402


def bench(name: str, model_dir: str, args) -> list[dict]:
    from jaxserve.engine.core import EngineCore

    config = EngineConfig(
        model=model_dir,
        cache=CacheConfig(block_size=16),
        scheduler=SchedulerConfig(
            max_num_seqs=64, max_num_batched_tokens=512, max_model_len=256,
            num_decode_steps=args.decode_steps,
        ),
    )  # fmt: skip
    engine = EngineCore(config)
    vocab = engine.model_config.vocab_size
    bo.configure(engine, True, args.decode_steps, True)  # warm-up: every executable once
    bo.run_batch(engine, bo.shared_prefix_prompts(8, 64, vocab, 0), 8, False)
    rows = []
    for batch in args.batches:
        runs: dict[bool, list[float]] = {True: [], False: []}
        for rep in range(args.repeats):
            for on in (True, False) if rep % 2 == 0 else (False, True):
                bo.configure(engine, on, args.decode_steps, True)
                seed = 1000 * rep + batch + (7 if on else 0)  # fresh prompts every run
                prompts = bo.shared_prefix_prompts(batch, 64, vocab, seed=seed)
                tokens, seconds, *_ = bo.run_batch(engine, prompts, args.max_tokens, False)
                runs[on].append(tokens / seconds)
        a, s = statistics.median(runs[True]), statistics.median(runs[False])
        row = {
            "model": name, "batch": batch, "decode_steps": args.decode_steps,
            "async_tok_s": a, "sync_tok_s": s, "sync_over_async": s / a,
            "runs": {"async": runs[True], "sync": runs[False]}, "load": os.getloadavg()[0],
        }  # fmt: skip
        rows.append(row)
        print(
            f"{name:<6}{batch:>6}{args.decode_steps:>3}{a:>10.0f}{s:>10.0f}{s / a:>8.2f}"
            f"{row['load']:>7.2f}",
            flush=True,
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="demo,large")
    ap.add_argument("--batches", default="1,8,32,128")
    ap.add_argument("--decode-steps", type=int, default=SchedulerConfig().num_decode_steps)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--out", default="bench_results/async_ab.json")
    args = ap.parse_args()
    args.batches = [int(b) for b in args.batches.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="jaxserve_async_ab_"))
    dirs = {"demo": str(DEMO_MODEL_DIR)}
    if "large" in args.models:
        dirs["large"] = str(bo.write_random_checkpoint(tmp / "large", bo.LARGE_SHAPE, 2048))
    print(f"# load average at start: {os.getloadavg()}, {os.cpu_count()} CPUs")
    print(f"{'model':<6}{'batch':>6}{'k':>3}{'async':>10}{'sync':>10}{'s/a':>8}{'load':>7}")
    rows = [r for name in args.models.split(",") for r in bench(name, dirs[name], args)]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"cpus": os.cpu_count(), "rows": rows}, indent=1))
    print(f"# wrote {out}")


if __name__ == "__main__":
    main()
