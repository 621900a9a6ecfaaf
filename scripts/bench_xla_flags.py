"""XLA CPU options A/B: the offline engine's tok/s under several XLA_FLAGS settings.

One `compare_hf.py` jaxserve worker per setting (XLA_FLAGS is read once, when the CPU
client starts, so each setting needs its own process), all started before the timing;
then per batch and repetition every worker generates the same fresh prompts in turn,
the order rotating per repetition (interleaved A/B/C); medians. Greedy tokens are
compared with the first setting's (a flag that changes them is not a free speed-up).
Only the worker generating runs; the others idle on their stdin.

    python scripts/bench_xla_flags.py [--models qwen3moe] [--batches 1,128]
        [--max-tokens 32] [--repeats 3] [--flags=";--xla_cpu_multi_thread_eigen=false"]
        [--out bench_results/xla_flags.json]

A setting is the whole XLA_FLAGS of its worker (the engine sets no XLA flags of its own;
the first setting, "", is XLA's defaults).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_FLAGS = [
    "",
    "--xla_cpu_multi_thread_eigen=false",
    "--xla_cpu_use_xnnpack=true",
]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="qwen3moe")
    parser.add_argument("--batches", default="1,128")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-model-len", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--flags",
        default=";".join(DEFAULT_FLAGS),
        help="the XLA_FLAGS settings, separated by ';' (an empty one: XLA's defaults)",
    )
    parser.add_argument("--out", default="bench_results/xla_flags.json")
    args = parser.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    args.flags = args.flags.split(";")

    sys.path.insert(0, str(HERE))
    from bench_offline import write_random_checkpoint
    from compare_hf import QWEN3MOE_SHAPE, _agreement, _prompts
    from compare_hf_sides import Worker

    from jaxserve.config import DEMO_MODEL_DIR

    print(f"# {platform.node()}: {os.cpu_count()} CPUs; load average {os.getloadavg()}")
    print(f"# greedy, {args.max_tokens} tokens, {args.repeats} interleaved repetitions, medians")
    print(
        f"{'model':9} {'batch':>5} {'tok/s':>8} {'vs first':>8} {'agree':>6} {'load':>5}  XLA_FLAGS"
    )
    rows = []
    with tempfile.TemporaryDirectory(prefix="jaxserve_xla_flags_") as tmp:
        for name in args.models.split(","):
            if name == "demo":
                model = str(DEMO_MODEL_DIR)
            else:
                model = str(write_random_checkpoint(Path(tmp) / name, QWEN3MOE_SHAPE, 2048))
            vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
            workers = [
                Worker(
                    "jaxserve", model, max(batches), args.max_model_len,
                    env={"XLA_FLAGS": f},
                )
                for f in args.flags
            ]  # fmt: skip
            try:
                for w in workers:  # warm-up
                    w.call(op="generate", prompts=_prompts(2, args.prompt_len, vocab, 1),
                           max_tokens=4)  # fmt: skip
                for batch in batches:
                    tps = [[] for _ in workers]
                    agree = [[] for _ in workers]
                    for rep in range(args.repeats):
                        prompts = _prompts(batch, args.prompt_len, vocab, 7000 * batch + rep)
                        order = list(range(len(workers)))
                        order = order[rep % len(order) :] + order[: rep % len(order)]
                        got = {}
                        for i in order:
                            r = workers[i].call(
                                op="generate", prompts=prompts, max_tokens=args.max_tokens
                            )
                            got[i] = r["tokens"]
                            tps[i].append(batch * args.max_tokens / r["seconds"])
                        for i in got:
                            agree[i].append(_agreement(got[0], got[i]))
                    base = statistics.median(tps[0])
                    for i, f in enumerate(args.flags):
                        med = statistics.median(tps[i])
                        row = dict(model=name, batch=batch, xla_flags=f, tok_s=med,
                                   vs_first=med / base, agreement=min(agree[i]),
                                   runs=tps[i], load=os.getloadavg()[0])  # fmt: skip
                        rows.append(row)
                        print(
                            f"{name:9} {batch:5d} {med:8.1f} {med / base:8.2f} "
                            f"{100 * row['agreement']:5.1f}% {row['load']:5.2f}  {f!r}",
                            flush=True,
                        )
            finally:
                for w in workers:
                    w.close()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {"machine": platform.node(), "args": vars(args), "rows": rows}
    out.write_text(json.dumps(result, indent=1))
    print(f"# wrote {out}")


if __name__ == "__main__":
    main()
