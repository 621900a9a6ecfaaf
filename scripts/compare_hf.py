"""jaxserve's offline `LLM.generate` against Hugging Face transformers' batched `generate`
(and llama.cpp, where given) on the same checkpoint, on the CPU (`bench_offline.py
--compare-hf` runs this).

Two models: the bundled demo model and a random-weight Qwen3-MoE (hidden 512, 8 layers,
32 experts, top-4, float32). For each batch size, every side generates `--max-tokens`
greedy tokens (EOS ignored) for the same fresh random prompts, in the order A, B, then
B, A (A, B, C, then C, B, A with a third side) for `--repeats` rounds; the table shows
median tok/s, the ratio, the share of greedy tokens on which jaxserve and transformers
agree, the load average when the row was taken, and each side's FLOP utilisation
against the f32 matmul ceiling measured in this run (the best side's).

Each side runs in its own worker process (compare_hf_sides.py), the others idle
meanwhile; the torch worker runs with OMP_WAIT_POLICY=PASSIVE, since spin-waiting OpenMP
threads collapse on an oversubscribed CPU and would make the comparison say nothing
(llama.cpp keeps OpenMP's default: passive sleeps its threads between graph runs, which
measured 10x slower at batch 1 on the demo model; the load column shows a busy machine).
Prompts are new every repetition, so jaxserve's prefix cache does not serve repeats.
After each side's run the harness waits `--settle` seconds before the next one: a
side's threads may go on spinning after its call returns (llama.cpp's OpenMP threads
with the default wait policy do), and the next side would run beside them (measured
on the demo model at batch 1: jaxserve right after llama.cpp 595 tok/s, after its own
run 1850).

    python scripts/bench_offline.py --compare-hf [--batches 1,8,32,128] [--max-tokens 64]
        [--prompt-len 32] [--repeats 3] [--models demo,qwen3moe]
        [--baseline-python OLD_VENV/bin/python] [--out bench_results/compare_hf.json]
        [--llama-python LLAMA_VENV/bin/python --llama-converter convert_hf_to_gguf.py]

With `--llama-python` (an interpreter with llama-cpp-python, which is no dependency of
this project) a third side runs llama.cpp on an f32 GGUF of the same checkpoint, one
thread per CPU, batched greedy decode of the same prompts; the table adds its tok/s, jaxserve /
llama.cpp and its greedy agreement with jaxserve. How to build it and what the GGUF
conversion does: compare_llama_cpp.py.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # the helpers beside this script, when it is imported

from compare_hf_sides import Worker  # noqa: E402

# The random Qwen3-MoE of the comparison (the issue's "hidden 512, 8 layers, 32 experts,
# top-4"); vocab 4096 so that the demo model's tokenizer can detokenize its ids.
QWEN3MOE_SHAPE = dict(
    vocab_size=4096, hidden_size=512, moe_intermediate_size=256, num_hidden_layers=8,
    num_attention_heads=8, num_key_value_heads=4, head_dim=64, num_experts=32,
    num_experts_per_tok=4,
)  # fmt: skip


def flops_per_token(cfg: dict, context: float) -> float:
    """Forward FLOPs of one token (2 per multiply-add): the weights a token uses (attention
    projections, the gate, its top-k experts, the LM head) plus attention over `context`
    positions (QK^T and PV)."""
    h = cfg["hidden_size"]
    hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    experts = cfg["num_experts_per_tok"] * 3 * h * cfg["moe_intermediate_size"]
    per_layer = h * q + 2 * h * kv + q * h + h * cfg["num_experts"] + experts
    weights = cfg["num_hidden_layers"] * per_layer + h * cfg["vocab_size"]
    attention = cfg["num_hidden_layers"] * 2 * q * context
    return 2.0 * (weights + attention)


# ---------------------------------------------------------------------------- driver


def _prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab) for _ in range(length)] for _ in range(batch)]


def _agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Share of positions where both sides' greedy tokens agree, counting each sample up
    to its first disagreement (after it, the continuations differ by construction)."""
    same = total = 0
    for x, y in zip(a, b, strict=True):
        n = next((i for i, (s, t) in enumerate(zip(x, y, strict=True)) if s != t), len(x))
        same += n
        total += len(x)
    return same / max(total, 1)


def compare_model(name: str, model: str, cfg: dict, args, gguf: str | None) -> list[dict]:
    max_batch = max(args.batches)
    sides = {
        "jaxserve": Worker("jaxserve", model, max_batch, args.max_model_len),
        "transformers": Worker("transformers", model, max_batch, args.max_model_len),
    }
    if args.baseline_python:  # the same jaxserve side, from another install (an old commit)
        sides["baseline"] = Worker(
            "jaxserve", model, max_batch, args.max_model_len, python=args.baseline_python
        )
    if gguf:
        sides["llama.cpp"] = Worker(
            "llama.cpp", gguf, max_batch, args.max_model_len, python=args.llama_python
        )
    try:
        # Warm-up: one small batch each (jaxserve compiled at start; torch's first call).
        for w in sides.values():
            w.call(op="generate", prompts=_prompts(2, args.prompt_len, cfg["vocab_size"], 1),
                   max_tokens=4)  # fmt: skip
            time.sleep(args.settle)
        # The ceiling once every side is loaded and idle, the best of two rounds: measured
        # while another side still loaded (the first call used to be), it read ~20% low
        # (146 vs 188 GFLOP/s), which flatters every MFU column.
        ceiling = max(w.call(op="ceiling")["flops_per_s"] for _ in range(2) for w in sides.values())
        rows = []
        context = args.prompt_len + args.max_tokens / 2
        for batch in args.batches:
            tps = {s: [] for s in sides}
            agree, llama_agree = [], []
            for rep in range(args.repeats):
                prompts = _prompts(batch, args.prompt_len, cfg["vocab_size"], 1000 * batch + rep)
                got = {}
                order = list(sides) if rep % 2 == 0 else list(reversed(sides))  # interleaved
                for s in order:
                    r = sides[s].call(op="generate", prompts=prompts, max_tokens=args.max_tokens)
                    time.sleep(args.settle)  # see the module docstring
                    got[s] = r["tokens"]
                    tps[s].append(batch * args.max_tokens / r["seconds"])
                agree.append(_agreement(got["jaxserve"], got["transformers"]))
                if "llama.cpp" in got:
                    llama_agree.append(_agreement(got["jaxserve"], got["llama.cpp"]))
            med = {s: statistics.median(v) for s, v in tps.items()}
            # FLOPs of the run: prompt tokens (prefill) + generated tokens, per token.
            tokens_per_gen = (args.prompt_len + args.max_tokens) / args.max_tokens
            mfu = {s: med[s] * tokens_per_gen * flops_per_token(cfg, context) / ceiling
                   for s in sides}  # fmt: skip
            row = dict(
                model=name, batch=batch, jaxserve_tok_s=med["jaxserve"],
                hf_tok_s=med["transformers"], ratio=med["jaxserve"] / med["transformers"],
                agreement=min(agree), jaxserve_mfu=mfu["jaxserve"], hf_mfu=mfu["transformers"],
                ceiling_gflop_s=ceiling / 1e9, load_avg=os.getloadavg()[0],
                jaxserve_runs=tps["jaxserve"], hf_runs=tps["transformers"],
            )  # fmt: skip
            if "baseline" in sides:
                row.update(baseline_tok_s=med["baseline"], baseline_runs=tps["baseline"],
                           speedup_vs_baseline=med["jaxserve"] / med["baseline"])  # fmt: skip
            if "llama.cpp" in sides:
                row.update(llama_tok_s=med["llama.cpp"], jaxserve_vs_llama=med["jaxserve"]
                           / med["llama.cpp"], llama_agreement=min(llama_agree),
                           llama_mfu=mfu["llama.cpp"], llama_runs=tps["llama.cpp"])  # fmt: skip
            rows.append(row)
            print_row(row)
        return rows
    finally:
        for w in sides.values():
            w.close()


HEADER = (
    f"{'model':<9} {'batch':>5} {'jaxserve tok/s':>14} {'spread':>6} {'HF tok/s':>9} {'ratio':>6} "
    f"{'agree':>6} {'jax MFU':>8} {'HF MFU':>7} {'ceiling GF/s':>12} {'load':>5}"
)
# jaxserve / llama.cpp and the share of greedy tokens where llama.cpp agrees with jaxserve.
LLAMA_HEADER = (
    f" {'llama.cpp tok/s':>15} {'spread':>6} {'jax/llama':>9} {'agree':>6} {'llama MFU':>9}"
)


def spread(runs: list[float]) -> float:
    """(max - min) / median of one side's tok/s over the repetitions: how far apart its
    runs were, beside the median it is quoted by (on a shared 2-core VM the same build's
    runs of one row measured up to 60% apart, on the demo model at batch 1, so a ratio
    within the spreads is no result)."""
    return (max(runs) - min(runs)) / statistics.median(runs)


def print_row(r: dict) -> None:
    extra = ""
    if "llama_tok_s" in r:
        extra += (
            f" {r['llama_tok_s']:>15.1f} {100 * spread(r['llama_runs']):>5.0f}% "
            f"{r['jaxserve_vs_llama']:>9.2f} "
            f"{100 * r['llama_agreement']:>5.1f}% {100 * r['llama_mfu']:>8.1f}%"
        )
    if "baseline_tok_s" in r:
        extra += f"  baseline {r['baseline_tok_s']:.1f} tok/s (x{r['speedup_vs_baseline']:.2f})"
    print(
        f"{r['model']:<9} {r['batch']:>5} {r['jaxserve_tok_s']:>14.1f} "
        f"{100 * spread(r['jaxserve_runs']):>5.0f}% {r['hf_tok_s']:>9.1f} "
        f"{r['ratio']:>6.2f} {100 * r['agreement']:>5.1f}% {100 * r['jaxserve_mfu']:>7.1f}% "
        f"{100 * r['hf_mfu']:>6.1f}% {r['ceiling_gflop_s']:>12.1f} {r['load_avg']:>5.2f}{extra}",
        flush=True,
    )


def llama_python(given: str | None, converter: str | None) -> tuple[str | None, str | None]:
    """The interpreter that runs the llama.cpp side (None: no such side) and, when this
    interpreter has llama_cpp but the side is skipped, why (one line to print).

    given: --llama-python; converter: --llama-converter. Without --llama-python the side
    runs in this interpreter when it can import llama_cpp and the converter is given;
    without the converter (which makes the GGUFs) it is skipped, not an error.
    Raises ValueError when --llama-python is given without --llama-converter.
    """
    if given is not None:
        if not converter:
            raise ValueError("--llama-python needs --llama-converter (see compare_llama_cpp.py)")
        return given, None
    if importlib.util.find_spec("llama_cpp") is None:
        return None, None
    if not converter:
        return None, (
            "llama_cpp is importable here, but no --llama-converter (llama.cpp's "
            "convert_hf_to_gguf.py) was given to make the GGUFs"
        )
    return sys.executable, None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", default="1,8,32,128")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-model-len", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--models", default="demo,qwen3moe")
    parser.add_argument(
        "--settle", type=float, default=1.0,
        help="seconds to wait after each side's run, so its spinning threads go to sleep",
    )  # fmt: skip
    parser.add_argument("--out", default="bench_results/compare_hf.json")
    parser.add_argument(
        "--baseline-python",
        help="also run jaxserve from this interpreter's install (e.g. an old commit's venv), "
        "interleaved with the others: before/after in one run",
    )
    parser.add_argument(
        "--llama-python",
        help="an interpreter with llama-cpp-python: adds llama.cpp on an f32 GGUF of each "
        "model (default: this interpreter, when it has llama_cpp and --llama-converter is "
        "given; without the converter the column is skipped with a line saying why)",
    )
    parser.add_argument(
        "--llama-converter",
        help="llama.cpp's convert_hf_to_gguf.py (of the llama.cpp that llama-cpp-python "
        "vendors), which makes the GGUFs",
    )
    args = parser.parse_args(argv)
    args.batches = [int(b) for b in args.batches.split(",")]
    try:
        args.llama_python, skipped = llama_python(args.llama_python, args.llama_converter)
    except ValueError as e:
        parser.error(str(e))
    if skipped:
        print(f"# llama.cpp: not compared ({skipped})")

    from bench_offline import write_random_checkpoint
    from compare_llama_cpp import has_llama_cpp, make_gguf

    from jaxserve.config import DEMO_MODEL_DIR

    models = {}
    with tempfile.TemporaryDirectory(prefix="jaxserve_compare_") as tmp:
        for name in args.models.split(","):
            if name == "demo":
                models[name] = str(DEMO_MODEL_DIR)
            elif name == "qwen3moe":
                models[name] = str(write_random_checkpoint(Path(tmp) / name, QWEN3MOE_SHAPE, 2048))
            else:
                parser.error(f"--models: unknown model {name!r} (demo, qwen3moe)")
        ggufs = dict.fromkeys(models)
        if args.llama_python and has_llama_cpp(args.llama_python):
            for name, path in models.items():
                out = Path(tmp) / f"{name}-f32.gguf"
                ggufs[name] = str(make_gguf(args.llama_converter, Path(path), DEMO_MODEL_DIR, out))
        elif not skipped:
            why = f"{args.llama_python} cannot import llama_cpp" if args.llama_python else (
                "no --llama-python, an interpreter with llama-cpp-python")  # fmt: skip
            print(f"# llama.cpp: not compared ({why})")
        print(f"# {platform.node()}: {os.cpu_count()} CPUs; load average {os.getloadavg()}")
        print(
            f"# greedy, {args.max_tokens} output tokens, prompts of {args.prompt_len} random "
            f"tokens (new each repetition), {args.repeats} interleaved repetitions, medians"
        )
        print(HEADER + (LLAMA_HEADER if any(ggufs.values()) else ""), flush=True)
        rows = []
        for name, path in models.items():
            cfg = json.loads((Path(path) / "config.json").read_text())
            rows += compare_model(name, path, cfg, args, ggufs[name])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {
        "machine": {"node": platform.node(), "cpus": os.cpu_count(), "python": sys.version},
        "args": vars(args),
        "rows": rows,
    }
    out.write_text(json.dumps(result, indent=1))
    print(f"# wrote {out}")


if __name__ == "__main__":
    main()
