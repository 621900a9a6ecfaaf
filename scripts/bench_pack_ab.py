"""Input packing A/B: this tree's `InputBuilder.build` against a git ref's, on the same
scheduler decisions, with the packed buffers compared for equality.

Runs the demo model's offline engine at batch 1, 8, 32 and 128 (greedy, EOS ignored)
and records every decision the engine packs (`ModelRunner.prepare`'s arguments). After
each step it packs that decision again with both builders, the order alternating, and
times them: host work only, no device. The two packings must give identical int32 and
float32 buffers and the same pending tokens; any difference is an error.

    python scripts/bench_pack_ab.py [--baseline-ref HEAD] [--batches 1,8,32,128]
        [--max-tokens 32] [--repeats 5] [--out bench_results/pack_ab.json]

The baseline's step_inputs.py is loaded from `git show REF:jaxserve/engine/step_inputs.py`
as a module of its own (it must import against this tree's other modules).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402
from module_at_ref import load_module_at_ref  # noqa: E402  (beside this script)


def load_baseline(ref: str):
    return load_module_at_ref(ref, "jaxserve/engine/step_inputs.py", "baseline_step_inputs")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline-ref", default="HEAD")
    parser.add_argument("--batches", default="1,8,32,128")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="bench_results/pack_ab.json")
    args = parser.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]

    from jaxserve import LLM, SamplingParams
    from jaxserve.engine import model_runner

    baseline = load_baseline(args.baseline_ref)
    llm = LLM(max_num_seqs=max(batches), max_model_len=256)
    runner = llm.engine.runner
    new = runner.builder
    old = baseline.InputBuilder(
        new.token_buckets, new.max_num_seqs, new.max_model_len, new.block_size,
        new.vocab_size, new.decode_steps,
        # as ModelRunner builds its own: small batches run more steps a call on the CPU
        cpu_decode_factors=True,
    )  # fmt: skip
    times: dict[int, dict[str, list[float]]] = {b: {"baseline": [], "this": []} for b in batches}
    current = [0]
    prepare = runner.prepare

    def timed_prepare(sched, in_flight=None):
        x = prepare(sched, in_flight)
        rows = model_runner._rows(in_flight) if in_flight else {}
        builders = {"baseline": old, "this": new}
        built = {}
        for rep in range(args.repeats):
            order = ["baseline", "this"] if rep % 2 == 0 else ["this", "baseline"]
            for name in order:
                t0 = time.perf_counter()
                built[name] = builders[name].build(sched, rows)
                times[current[0]][name].append(time.perf_counter() - t0)
        a, b = built["baseline"], built["this"]
        for i in (0, 1):
            if not np.array_equal(a.buffers[i], b.buffers[i]):
                raise AssertionError(f"packed buffer {i} differs from the baseline's")
        # This tree's pending entries lead with the dp rank (one rank here); a baseline
        # from before the rank-aware builder (57ff37d) has no rank field.
        ours_t, ours_h = b.pending_tokens, b.pending_history
        if a.pending_tokens and len(a.pending_tokens[0]) < len(ours_t[0]):
            ours_t = [p[1:] for p in ours_t]
        if a.pending_history and len(a.pending_history[0]) < len(ours_h[0]):
            ours_h = [p[1:] for p in ours_h]
        if a.pending_tokens != ours_t or a.pending_history != ours_h:
            raise AssertionError("pending tokens differ from the baseline's")
        return x

    runner.prepare = timed_prepare
    rng = random.Random(0)
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    print(f"# {platform.node()}: {os.cpu_count()} CPUs; load average {os.getloadavg()}")
    print(f"# baseline: {args.baseline_ref}; buffers identical on every step")
    print(
        f"{'batch':>5} {'steps':>5} {'baseline ms':>11} {'this ms':>8} {'speed-up':>8} {'load':>5}"
    )
    rows = []
    for batch in batches:
        current[0] = batch
        prompts = [[rng.randrange(4096) for _ in range(args.prompt_len)] for _ in range(batch)]
        llm.generate(prompts, sp)
        t = times[batch]
        med = {k: 1e3 * statistics.median(v) for k, v in t.items()}
        row = dict(batch=batch, steps=len(t["this"]) // args.repeats, baseline_ms=med["baseline"],
                   this_ms=med["this"], speedup=med["baseline"] / med["this"],
                   load=os.getloadavg()[0])  # fmt: skip
        rows.append(row)
        print(
            f"{batch:5d} {row['steps']:5d} {med['baseline']:11.3f} {med['this']:8.3f} "
            f"{row['speedup']:8.2f} {row['load']:5.1f}",
            flush=True,
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": platform.node(), "args": vars(args), "rows": rows}))
    print(f"# wrote {out}")


if __name__ == "__main__":
    main()
