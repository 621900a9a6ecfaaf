"""What one engine step's device time is made of: XLA CPU ops by total time, from a JAX
profiler trace of `LLM.generate` on the random Qwen3-MoE of `compare_hf.py` (or the demo).

For each batch size: build the offline engine once (as `compare_hf.py`: max_num_seqs =
the largest batch, max_model_len 256), warm it, then generate `--max-tokens` greedy
tokens for `batch` fresh random prompts under `jax.profiler` (host tracer only, Python
tracer off) and sum the trace's events by name (the perfetto JSON the profiler writes:
on the CPU every XLA thunk is one event named after its HLO op or fusion). Prints the
top `--top` names with their share of the traced wall time and their count (nested
events, a while loop and the ops inside it, both count, so shares can add up past 100%),
then the time by call kind (multi-step decode or not) and op kind (each C++ kernel by
its FFI target, XLA's dots, the other XLA ops; `breakdown`), with `uptime`; writes
bench_results/step_ops.json. The trace names a kernel call only `ffi_call.N`; its target
comes from the optimized HLO that XLA dumps into a temporary folder (`--xla_dump_to`).

    python scripts/bench_step_ops.py [--model qwen3moe|demo] [--batches 1,128]
        [--max-tokens 32] [--top 25]
"""

from __future__ import annotations

import argparse
import atexit
import bisect
import gzip
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Before JAX loads: the optimized HLO, to name each ffi_call's kernel and tell a
# ynn_fusion's dots from its reductions (`_ffi_targets`).
_HLO_DUMP = tempfile.mkdtemp(prefix="jaxserve_ops_hlo_")
atexit.register(shutil.rmtree, _HLO_DUMP, ignore_errors=True)
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + f" --xla_dump_to={_HLO_DUMP} --xla_dump_hlo_as_text --xla_dump_hlo_pass_re=^$"
)

HERE = Path(__file__).resolve().parent
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (.*)$", re.M)
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_FUSED = re.compile(r"^%(fused_computation[\w.\-]*) .*?^}", re.M | re.S)
_CALLS = re.compile(r"calls=%([\w.\-]+)")


def _dumped_modules() -> list[tuple[str, set[str], dict[str, str]]]:
    """The optimized modules XLA dumped: (module name, its instruction names, op ->
    what it runs: an ffi_call's custom-call target, a ynn_fusion's "dot" if its fused
    computation has a dot, else "no dot" (YNNPACK also fuses reductions: RMSNorm's sum of
    squares, the router's softmax))."""
    out = []
    for path in sorted(Path(_HLO_DUMP).glob("*after_optimizations.txt")):
        module = re.match(r"module_\d+\.(.+?)\.", path.name)
        if module is None:
            continue
        text = path.read_text()
        has_dot = {m.group(1): " dot(" in m.group(0) for m in _FUSED.finditer(text)}
        names, targets = set(), {}
        for name, rest in _INSTRUCTION.findall(text):
            names.add(name)
            if name.startswith("ffi_call") and (target := _TARGET.search(rest)):
                targets[name] = target.group(1)
            elif name.startswith("ynn_fusion") and (called := _CALLS.search(rest)):
                targets[name] = "dot" if has_dot.get(called.group(1)) else "no dot"
        out.append((module.group(1), names, targets))
    return out


def _ffi_targets(call_ops: list[dict], modules) -> dict[str, str]:
    """op -> what it runs (`_dumped_modules`) for one device call's ops: from the dumped
    module of that name (the engine compiles several variants of `jit_step`, each
    numbering its ops anew) holding the most of the call's op names."""
    names = {o["name"] for o in call_ops}
    module = next(((o.get("args") or {}).get("hlo_module") for o in call_ops), None)
    best = max(
        (m for m in modules if m[0] == module), key=lambda m: len(names & m[1]), default=None
    )
    return best[2] if best is not None else {}


def _events(trace_dir: Path) -> list[dict]:
    files = sorted(trace_dir.rglob("*.trace.json.gz")) or sorted(trace_dir.rglob("*.json.gz"))
    if not files:
        raise FileNotFoundError(f"no perfetto trace under {trace_dir}")
    with gzip.open(files[-1]) as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def profile_batch(llm, batch: int, args) -> dict:
    import jax

    from jaxserve import SamplingParams

    rng = random.Random(batch)
    vocab = llm.engine.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)

    def prompts():
        return [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(batch)]

    llm.generate(prompts(), params)  # warm
    with tempfile.TemporaryDirectory(prefix="jaxserve_ops_") as tmp:
        options = jax.profiler.ProfileOptions()
        options.python_tracer_level = 0
        options.host_tracer_level = 2
        jax.profiler.start_trace(tmp, create_perfetto_trace=True, profiler_options=options)
        start = time.perf_counter()
        llm.generate(prompts(), params)
        wall = time.perf_counter() - start
        jax.profiler.stop_trace()
        events = _events(Path(tmp))
    by_call = breakdown(events, wall)
    total: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    for e in events:
        if e.get("ph") == "X" and "dur" in e:
            total[e["name"]] += e["dur"] * 1e-6
            count[e["name"]] += 1
    top = sorted(total, key=total.get, reverse=True)[: args.top]
    tokens = batch * args.max_tokens
    print(f"\n## batch {batch}: {tokens / wall:.1f} tok/s, traced wall {wall:.2f} s")
    print(f"{'op':<60} {'ms':>9} {'share':>6} {'count':>7}")
    rows = []
    for name in top:
        share = total[name] / wall
        print(f"{name[:60]:<60} {1e3 * total[name]:>9.1f} {share:>6.1%} {count[name]:>7}")
        rows.append(dict(name=name, seconds=total[name], share=share, count=count[name]))
    print(f"\n{'call kind':<22} {'op kind':<28} {'ms':>9} {'share':>6}")
    for (kind, cat), seconds in by_call.items():
        print(f"{kind:<22} {cat:<28} {1e3 * seconds:>9.1f} {seconds / wall:>6.1%}")
    by_call_rows = [dict(call=k, ops=c, seconds=v) for (k, c), v in by_call.items()]
    return dict(batch=batch, tok_s=tokens / wall, wall_s=wall, top=rows, by_call=by_call_rows)


def _op_kind(name: str, targets: dict[str, str]) -> str:
    if name.startswith("ffi_call"):
        return f"kernel {targets.get(name, '?').removeprefix('jaxserve_')}"
    if name.startswith("ynn_fusion"):
        dots = targets.get(name, "dot") == "dot"
        return "XLA dots (ynn_fusion)" if dots else "XLA reductions (ynn_fusion)"
    return "other XLA ops"


def breakdown(events: list[dict], wall: float) -> dict[tuple[str, str], float]:
    """Seconds by (call kind, op kind): each XLA op event goes to the device call whose
    "wait for completion" event spans it; a call is "multi-step decode" if it runs a while
    loop (the multi-step decode family), else "prefill / single step". ("calls", "wall")
    is the calls' own time and ("host", "between calls") the traced wall outside them.
    Ops that overlap (XLA runs independent ones side by side) each count in full."""
    calls = sorted(
        (e for e in events if e.get("name") == "ThunkExecutor::Execute (wait for completion)"),
        key=lambda e: e["ts"],
    )
    starts = [c["ts"] for c in calls]
    ops: dict[int, list[dict]] = defaultdict(list)
    for e in events:  # while and cond events wrap ops counted on their own
        if e.get("ph") != "X" or not (e.get("args") or {}).get("hlo_op"):
            continue
        i = bisect.bisect_right(starts, e["ts"]) - 1
        if i >= 0 and e["ts"] <= calls[i]["ts"] + calls[i]["dur"]:
            ops[i].append(e)
    modules = _dumped_modules()
    out: dict[tuple[str, str], float] = defaultdict(float)
    for i, call in enumerate(calls):
        targets = _ffi_targets(ops[i], modules)
        loop = any(o["name"].startswith("while") for o in ops[i])
        kind = "multi-step decode" if loop else "prefill / single step"
        out[(kind, "calls' wall")] += call["dur"] * 1e-6
        for o in ops[i]:
            if not o["name"].startswith(("while", "cond")):
                out[(kind, _op_kind(o["name"], targets))] += o["dur"] * 1e-6
    out[("host", "between calls")] = wall - sum(c["dur"] * 1e-6 for c in calls)
    return dict(sorted(out.items()))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="qwen3moe", choices=["qwen3moe", "demo"])
    parser.add_argument("--batches", default="1,128")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-model-len", type=int, default=256)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--out", default="bench_results/step_ops.json")
    args = parser.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]

    sys.path.insert(0, str(HERE))
    from bench_offline import write_random_checkpoint
    from compare_hf import QWEN3MOE_SHAPE

    from jaxserve import LLM
    from jaxserve.config import DEMO_MODEL_DIR

    uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(f"# {uptime}")
    with tempfile.TemporaryDirectory(prefix="jaxserve_ops_model_") as tmp:
        if args.model == "demo":
            path = str(DEMO_MODEL_DIR)
        else:
            path = str(write_random_checkpoint(Path(tmp) / "qwen3moe", QWEN3MOE_SHAPE, 2048))
        llm = LLM(
            model=path,
            tokenizer=DEMO_MODEL_DIR,
            max_num_seqs=max(batches),
            max_model_len=args.max_model_len,
        )
        results = [profile_batch(llm, b, args) for b in batches]
    uptime_end = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(f"\n# {uptime_end}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(uptime=[uptime, uptime_end], args=vars(args), rows=results)))
    print(f"# wrote {out}")


if __name__ == "__main__":
    main()
