"""The layer metrics' own cost: offline tokens/s of one engine with them on and off.

    python scripts/bench_metrics_cost.py [--batches 8,32] [--repeats 5] [--max-tokens 32]
        [--out bench_results/metrics_cost.json]

One `EngineCore` of the demo model (scripts/bench_offline.py's engine settings and its
`run_batch` / prompts, the default scheduling), so both variants run the same compiled
executables in one process. "off" routes the core's metered dispatch and fetch
(`EngineCore._dispatch` / `_fetch`: queue time, the step meter of MBU / MFU and per-step
tokens, the profiler's dispatch / wait spans) straight to the executor, as before the
layer metrics; "on" is the engine as it ships. Runs alternate (off, on, off, on, ...) so
machine load drifts over both alike; prints the median tokens/s of each, on/off - 1, and
the load average, and writes JSON. The goal (issue 11): under 2% difference.

On a shared machine the A/B's spread can exceed 2% by far, so it also measures the cost
directly: the scheduler decisions of one "on" run are kept, and the metered work of each
step (`StepMeter.dispatched` + `fetched`, the queue-time loop) is replayed on them
`--replays` times and timed; the median per step over the run's wall time per step is
the share of the engine's time the metrics take (both measured under the same load).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_offline import configure, run_batch, shared_prefix_prompts  # noqa: E402

from jaxserve.config import DEMO_MODEL_DIR, CacheConfig, EngineConfig, SchedulerConfig  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="8,32")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--replays", type=int, default=20, help="timed replays of the meter")
    ap.add_argument("--out", default="bench_results/metrics_cost.json")
    args = ap.parse_args(argv)
    from jaxserve.engine.core import EngineCore

    engine = EngineCore(EngineConfig(
        model=str(DEMO_MODEL_DIR), cache=CacheConfig(block_size=16),
        scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=512,
                                  max_model_len=256, num_decode_steps=4),
    ))  # fmt: skip
    vocab = engine.model_config.vocab_size
    mode = (engine.async_scheduling, SchedulerConfig().num_decode_steps)  # as resolved
    configure(engine, *mode, True)
    run_batch(engine, shared_prefix_prompts(8, args.prompt_len, vocab, 0), 8, False)  # warm

    def set_metrics(on: bool) -> None:
        for name in ("_dispatch", "_fetch"):
            engine.__dict__.pop(name, None)
        if not on:
            engine._dispatch, engine._fetch = engine.executor.dispatch, engine.executor.fetch

    rows = []
    load_before = os.getloadavg()

    def replay_share(prompts, replays: int) -> tuple[float, float]:
        """(metrics µs per step, share of the run's time per step); see the docstring."""
        scheds: list = []
        inner = engine.executor.dispatch

        def keep(x, sched):
            scheds.append(sched)
            return inner(x, sched)

        engine.executor.dispatch = keep
        configure(engine, *mode, True)
        _, seconds, steps, *_ = run_batch(engine, prompts, args.max_tokens, False)
        del engine.executor.dispatch
        meter, handle = engine.step_meter, object()
        times = []
        for _ in range(replays):
            t = time.perf_counter()
            for sched in scheds:
                for rank in getattr(sched, "ranks", None) or [sched]:
                    for row in rank.requests:
                        if row.seq.first_scheduled_time is None:  # never: already set
                            engine.queue_time.observe(0.0)
                meter.dispatched(handle, sched)
                meter.fetched(handle)
            times.append((time.perf_counter() - t) / len(scheds))
        per_step = statistics.median(times)
        return per_step * 1e6, per_step / (seconds / max(steps, 1))

    for batch in map(int, args.batches.split(",")):
        prompts = shared_prefix_prompts(batch, args.prompt_len, vocab, batch)
        tok_s: dict[str, list[float]] = {"off": [], "on": []}
        for _ in range(args.repeats):
            for variant in ("off", "on"):
                set_metrics(variant == "on")
                configure(engine, *mode, True)
                tokens, seconds, *_ = run_batch(engine, prompts, args.max_tokens, False)
                tok_s[variant].append(tokens / seconds)
        set_metrics(True)
        us, share = replay_share(prompts, args.replays)
        off, on = statistics.median(tok_s["off"]), statistics.median(tok_s["on"])
        rows.append({"batch": batch, "off_tok_s": off, "on_tok_s": on,
                     "on_vs_off": on / off - 1, "runs": tok_s,
                     "metrics_us_per_step": us, "metrics_share_of_step": share})  # fmt: skip
        print(f"batch {batch:4d}: off {off:8.1f} tok/s  on {on:8.1f} tok/s  "
              f"on/off-1 {100 * (on / off - 1):+.2f}%  (median of {args.repeats}); "
              f"metrics {us:.1f} us/step = {100 * share:.3f}% of a step  "
              f"(load {os.getloadavg()[0]:.1f})", flush=True)  # fmt: skip
    doc = {"rows": rows, "load_avg_before": load_before, "load_avg_after": os.getloadavg(),
           "cpus": os.cpu_count(), "time": time.time(), "max_tokens": args.max_tokens}  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
