"""Where one engine step's wall time goes: schedule, pack, dispatch, device, fetch, outputs.

Runs the offline engine (`LLM`'s `EngineCore`, as `compare_hf.py` builds it: max_num_seqs
= the largest batch, max_model_len 256, the default scheduling: 4-step decode calls,
async scheduling as the backend's default, off on the CPU) on the demo model and the
random Qwen3-MoE of `compare_hf.py`, at batch 1, 8, 32 and 128 (fresh random prompts,
greedy, EOS ignored), with the profiler's host timeline
on (`observability.profile.TIMELINE`: the spans `EngineCore.step` records). Per engine
call (`EngineCore.step`) it prints the mean milliseconds of each phase:

- schedule: `Scheduler.schedule`; pack: `ModelRunner.prepare` (`InputBuilder.build`);
- dispatch: `executor.dispatch` (host -> device copy of the packed buffers, enqueue);
- wait: the host blocked in `fetch` for the device (`runner.wait_time_s`); with async
  scheduling the device runs while the host schedules and packs the next step, so
  device time = wait + the host work it overlapped;
- fetch: copying the sampled tokens (and expert counts) back after the wait;
- outputs: `Scheduler.update` (tokens into requests, RequestOutputs);
- other: the rest of `EngineCore.step` (metering, EPLB poll, the engine's own loop).

With `--sync` the engine runs both with and without async scheduling (without, wait is
the device time of the step): the A/B behind the CPU's default. Modes and batches are
interleaved per repetition; medians.

    python scripts/bench_host_step.py [--models demo,qwen3moe] [--batches 1,8,32,128]
        [--max-tokens 64] [--repeats 3] [--sync] [--profile] [--out bench_results/host_step.json]

`--profile` prints the top functions by own time (cProfile) of the last repetition of
each batch, to name what to cut.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import platform
import pstats
import random
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402

HERE = Path(__file__).resolve().parent
PHASES = ("schedule", "pack", "dispatch", "wait", "fetch", "outputs", "other")


def run_once(engine, batch: int, prompt_len: int, max_tokens: int, seed: int, prof=None) -> dict:
    """One batch through `engine`; per-phase seconds summed over its steps."""
    from jaxserve.ipc import EngineRequest
    from jaxserve.observability.profile import TIMELINE

    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    sampling = dict(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i in range(batch):
        prompt = np.asarray([rng.randrange(vocab) for _ in range(prompt_len)], np.int32)
        engine.add_request(EngineRequest(f"s{seed}-{i}", prompt, dict(sampling)))
    totals: dict[str, float] = defaultdict(float)
    steps = tokens = 0
    TIMELINE.start()
    if prof is not None:
        prof.enable()
    start = time.perf_counter()
    while engine.has_work():
        wait0 = engine.runner.wait_time_s
        t0 = time.perf_counter()
        for out in engine.step():
            if out.error:
                raise RuntimeError(out.error)
            tokens += len(out.new_token_ids)
        totals["step"] += time.perf_counter() - t0
        totals["wait"] += engine.runner.wait_time_s - wait0
        steps += 1
    seconds = time.perf_counter() - start
    if prof is not None:
        prof.disable()
    TIMELINE.stop()
    for name, a, b in TIMELINE.events:
        totals[name] += b - a
    phases = {
        "schedule": totals["schedule"],
        "pack": totals["pack"],
        "dispatch": totals["dispatch"],
        "wait": totals["wait"],
        "fetch": totals["wait for device"] - totals["wait"],
        "outputs": totals["outputs"],
    }
    phases["other"] = totals["step"] - sum(phases.values())
    return dict(steps=steps, tokens=tokens, seconds=seconds, phases=phases)


def bench_model(name: str, model: str, args) -> list[dict]:
    from jaxserve import LLM
    from jaxserve.config import DEMO_MODEL_DIR

    llm = LLM(
        model=model,
        tokenizer=DEMO_MODEL_DIR,
        max_num_seqs=max(args.batches),
        max_model_len=args.max_model_len,
    )
    engine = llm.engine
    default = engine.async_scheduling  # the backend's default (config.resolve_async_scheduling)
    modes = [True, False] if args.sync else [default]
    run_once(engine, 4, args.prompt_len, 8, seed=0)  # warm caches of the smallest shapes
    samples: dict[tuple[int, bool], list[dict]] = defaultdict(list)
    profiles: dict[int, str] = {}
    seed = 1
    for rep in range(args.repeats):
        for batch in args.batches:
            for mode in modes:
                engine.async_scheduling = mode
                last = rep == args.repeats - 1 and mode == default and args.profile
                prof = cProfile.Profile() if last else None
                samples[batch, mode].append(
                    run_once(engine, batch, args.prompt_len, args.max_tokens, seed, prof)
                )
                seed += 1
                if prof is not None:
                    s = io.StringIO()
                    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(18)
                    profiles[batch] = s.getvalue()
    assert engine.num_compilations == 0, f"{engine.num_compilations} compilations after warm-up"
    rows = []
    for (batch, mode), runs in samples.items():

        def med(f, runs=runs):
            return statistics.median(f(r) for r in runs)

        row = dict(
            model=name,
            batch=batch,
            async_scheduling=mode,
            tok_s=med(lambda r: r["tokens"] / r["seconds"]),
            steps=med(lambda r: r["steps"]),
            ms_per_step=med(lambda r: 1e3 * r["seconds"] / r["steps"]),
            phases_ms={p: med(lambda r, p=p: 1e3 * r["phases"][p] / r["steps"]) for p in PHASES},
            load=os.getloadavg()[0],
        )
        rows.append(row)
    rows.sort(key=lambda r: (r["batch"], not r["async_scheduling"]))
    for row in rows:
        print_row(row)
    for batch, text in profiles.items():
        print(f"\n## {name} batch {batch}: top functions by own time (cProfile)\n{text}")
    return rows


HEADER = (
    f"{'model':9} {'batch':>5} {'mode':5} {'tok/s':>8} {'steps':>5} {'ms/step':>8} "
    + " ".join(f"{p:>8}" for p in PHASES)
    + f" {'load':>5}"
)


def print_row(r: dict) -> None:
    mode = "async" if r["async_scheduling"] else "sync"
    print(
        f"{r['model']:9} {r['batch']:5d} {mode:5} {r['tok_s']:8.1f} {r['steps']:5.0f} "
        f"{r['ms_per_step']:8.2f} "
        + " ".join(f"{r['phases_ms'][p]:8.2f}" for p in PHASES)
        + f" {r['load']:5.2f}",
        flush=True,
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="demo,qwen3moe")
    parser.add_argument("--batches", default="1,8,32,128")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-model-len", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sync", action="store_true", help="async and sync, interleaved")
    parser.add_argument("--profile", action="store_true", help="cProfile the last repetition")
    parser.add_argument("--out", default="bench_results/host_step.json")
    args = parser.parse_args(argv)
    args.batches = [int(b) for b in args.batches.split(",")]

    sys.path.insert(0, str(HERE))
    from bench_offline import write_random_checkpoint
    from compare_hf import QWEN3MOE_SHAPE

    from jaxserve.config import DEMO_MODEL_DIR

    print(f"# {platform.node()}: {os.cpu_count()} CPUs; load average {os.getloadavg()}")
    print(f"# XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")
    print("# ms per engine call (a 4-step decode call is one), medians of the repetitions")
    print(HEADER, flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="jaxserve_host_step_") as tmp:
        for name in args.models.split(","):
            if name == "demo":
                path = str(DEMO_MODEL_DIR)
            elif name == "qwen3moe":
                path = str(write_random_checkpoint(Path(tmp) / name, QWEN3MOE_SHAPE, 2048))
            else:
                parser.error(f"--models: unknown model {name!r} (demo, qwen3moe)")
            rows += bench_model(name, path, args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "machine": {"node": platform.node(), "cpus": os.cpu_count()},
                "xla_flags": os.environ.get("XLA_FLAGS", ""),
                "args": vars(args),
                "rows": rows,
            },
            indent=1,
        )
    )
    print(f"# wrote {out}")


if __name__ == "__main__":
    main()
