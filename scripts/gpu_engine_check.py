"""The whole engine on an accelerator: jaxserve's offline `LLM.generate`, greedy, on the
default JAX backend, against greedy tokens recorded on the CPU (the `engine` stage of
scripts/gpu_check.sh).

    # here, on the CPU: record the reference (same models, prompts and lengths)
    JAX_PLATFORMS=cpu python scripts/gpu_engine_check.py --record REF.json
    # on the GPU: generate, compare with the reference, time
    JAX_PLATFORMS=cuda python scripts/gpu_engine_check.py --reference REF.json --out OUT.json

Models: the bundled demo model and compare_hf's random Qwen3-MoE, whose float32 weights
are drawn in a child process on the CPU, so both machines hold the same weights. Per model
and batch: the tok/s of one timed greedy `generate` (fresh prompts, EOS ignored, after an
untimed run of the same batch on other prompts), and the share of greedy tokens equal to
the reference (compare_hf's agreement: each sample counts up to its first difference).
`--precision highest` sets JAX's default matmul precision: on an NVIDIA GPU the default
lets XLA run float32 dots in TF32, so greedy ties may break differently from the CPU.
Prints a table; writes JSON.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from compare_hf import QWEN3MOE_SHAPE, _agreement, _prompts  # noqa: E402

PROMPT_LEN, MAX_TOKENS, MAX_MODEL_LEN = 32, 32, 256


def _qwen3moe_checkpoint(folder: Path) -> Path:
    """compare_hf's random Qwen3-MoE, written by a CPU-only child process."""
    code = (
        "import sys; from pathlib import Path; from bench_offline import write_random_checkpoint;"
        f"from compare_hf import QWEN3MOE_SHAPE; write_random_checkpoint(Path(sys.argv[1]),"
        f" QWEN3MOE_SHAPE, {MAX_MODEL_LEN})"
    )
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join(sys.path))
    subprocess.run([sys.executable, "-c", code, str(folder)], check=True, env=env, cwd=HERE)
    return folder


def run_model(
    name: str, model: str, vocab: int, batches: list[int], max_num_seqs: int | None
) -> list[dict]:
    """Build the engine, then per batch one untimed and one timed greedy generate."""
    from jaxserve import LLM, SamplingParams
    from jaxserve.config import DEMO_MODEL_DIR

    start = time.perf_counter()
    llm = LLM(model=model, tokenizer=DEMO_MODEL_DIR, max_num_seqs=max_num_seqs or max(batches),
              max_model_len=MAX_MODEL_LEN)  # fmt: skip
    ready_s = time.perf_counter() - start
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    rows = []
    for batch in batches:
        llm.generate(_prompts(batch, PROMPT_LEN, vocab, 7 + batch), params)
        prompts = _prompts(batch, PROMPT_LEN, vocab, 1000 * batch)
        start = time.perf_counter()
        out = llm.generate(prompts, params)
        seconds = time.perf_counter() - start
        rows.append(dict(model=name, batch=batch, tok_s=batch * MAX_TOKENS / seconds,
                         ready_s=ready_s, tokens=[o.token_ids for o in out]))  # fmt: skip
        print(f"{name} batch {batch}: {rows[-1]['tok_s']:.0f} tok/s", flush=True)
    del llm
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--record", help="write the greedy tokens here (the CPU reference)")
    parser.add_argument("--reference", help="a --record file to compare with")
    parser.add_argument("--out", default="bench_results/gpu_engine_check.json")
    parser.add_argument("--batches", default="1,8,32,128")
    parser.add_argument("--models", default="demo,qwen3moe")
    parser.add_argument("--precision", choices=["default", "highest"], default="default")
    parser.add_argument("--max-num-seqs", type=int, help="default: the largest batch")
    parser.add_argument(
        "--stall-dump-s", type=float, default=90.0,
        help="print every thread's stack after this many seconds (0: never), for a stage "
        "that its time cap would end silently",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.stall_dump_s > 0:
        faulthandler.dump_traceback_later(args.stall_dump_s)
    # The engine logs its compilation progress: where a cold start spends its time.
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    import jax

    if args.precision == "highest":
        jax.config.update("jax_default_matmul_precision", "highest")
    batches = [int(b) for b in args.batches.split(",")]
    reference = json.loads(Path(args.reference).read_text()) if args.reference else None
    print(f"# backend {jax.default_backend()}: {jax.devices()}; precision {args.precision}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            if name == "demo":
                from jaxserve.config import DEMO_MODEL_DIR

                model, vocab = str(DEMO_MODEL_DIR), 4096
            else:
                model = str(_qwen3moe_checkpoint(Path(tmp) / name))
                vocab = QWEN3MOE_SHAPE["vocab_size"]
            rows += run_model(name, model, vocab, batches, args.max_num_seqs)
    if reference is not None:
        ref = {(r["model"], r["batch"]): r for r in reference["rows"]}
        print(f"{'model':<9} {'batch':>5} {'tok/s':>8} {'ref tok/s':>9} {'agree':>6}")
        for r in rows:
            want = ref.get((r["model"], r["batch"]))
            r["agreement"] = _agreement(r["tokens"], want["tokens"]) if want else None
            r["reference_tok_s"] = want["tok_s"] if want else None
            agree = f"{r['agreement']:.3f}" if want else "-"
            ref_tps = f"{want['tok_s']:.0f}" if want else "-"
            print(f"{r['model']:<9} {r['batch']:>5} {r['tok_s']:>8.0f} {ref_tps:>9} {agree:>6}")
    result = dict(backend=jax.default_backend(), devices=[str(d) for d in jax.devices()],
                  precision=args.precision, uptime=os.getloadavg(), rows=rows)  # fmt: skip
    for path in filter(None, [args.record, args.out]):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(result))
    if args.out:
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
