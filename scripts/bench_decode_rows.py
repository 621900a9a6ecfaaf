"""Device time of one decode call of a single request, by row bucket: is batch 1 worth
its own bucket, or is padding it to MIN_DECODE_ROWS rows free?

Builds the demo model's engine (as `scripts/bench_offline.py` does), compiles the
multi-step decode call (4 steps) at R = 1, 2 and 4 rows, and the plain one-step call at
its smallest token bucket (T = 16), each with one real request whose context is
--context tokens and the other rows padding; then times the calls interleaved
(--repeats rounds) and prints the median ms per call and per decode step.

    python scripts/bench_decode_rows.py [--context 96] [--repeats 30]
        [--out bench_results/decode_rows.json]

JAXSERVE_CPU_ATTENTION / JAXSERVE_SAMPLER select the attention and sampler variants
(see jaxserve/kernels/dispatch.py and jaxserve/engine/sampler.py).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

from jaxserve.config import DEMO_MODEL_DIR, CacheConfig, EngineConfig, SchedulerConfig  # noqa: E402
from jaxserve.engine.step_shapes import StepShape  # noqa: E402


def one_request_inputs(runner, shape: StepShape, context: int):
    """Packed buffers of `shape` with one decoding request (row 0) at `context` tokens."""
    x = runner.builder.empty(shape)
    md, bs = x.inputs.metadata, runner.block_size
    blocks = -(-(context + shape.num_steps) // bs)
    md.block_tables[0, :blocks] = range(1, blocks + 1)
    md.seq_lens[0] = context
    md.token_req[0] = 0
    md.slot_mapping[0] = (1 + (context - 1) // bs) * bs + (context - 1) % bs
    md.query_start_loc[1:] = 1
    x.inputs.positions[0] = context - 1
    x.inputs.tokens[0] = 5
    x.inputs.logits_indices[0] = 0
    return x.buffers


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--context", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--out", default="bench_results/decode_rows.json")
    args = parser.parse_args(argv)

    from jaxserve.engine.core import EngineCore

    config = EngineConfig(
        model=str(DEMO_MODEL_DIR),
        cache=CacheConfig(block_size=16),
        scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=512, max_model_len=256),
    )
    runner = EngineCore(config).runner
    shapes = [StepShape(r, r, num_steps=4) for r in (1, 2, 4)] + [StepShape(16, 16)]
    for shape in shapes:
        if shape not in runner.compiler._executables:
            runner.compiler._executables[shape] = runner._lower(shape).compile()
    inputs = {s: one_request_inputs(runner, s, args.context) for s in shapes}
    times = {s: [] for s in shapes}
    for _ in range(args.repeats + 2):  # the first two rounds warm up
        for s in shapes:
            start = time.perf_counter()
            jax.block_until_ready(runner.run_buffers(s, inputs[s]))
            times[s].append(time.perf_counter() - start)
    print(f"# load average: {os.getloadavg()}; context {args.context}")
    print(f"{'T':>4} {'R':>4} {'steps':>5} {'ms/call':>8} {'ms/step':>8}")
    rows = []
    for s in shapes:
        ms = 1e3 * statistics.median(times[s][2:])
        per_step = ms / s.num_steps
        print(f"{s.num_tokens:>4} {s.num_rows:>4} {s.num_steps:>5} {ms:>8.2f} {per_step:>8.2f}")
        rows.append(dict(shape=s._asdict(), ms_per_call=ms, ms_per_step=ms / s.num_steps))
    env = {k: os.environ.get(k) for k in ("JAXSERVE_CPU_ATTENTION", "JAXSERVE_SAMPLER")}
    result = {"args": vars(args), "load": os.getloadavg(), "rows": rows, "env": env}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"# wrote {out}")


if __name__ == "__main__":
    main()
