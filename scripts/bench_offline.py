"""Offline engine throughput: output tokens/s and per-step host vs device time.

Runs `EngineCore` in this process (no frontend, no text: token ids in and out) on two
models: the bundled demo model (or a random-weight checkpoint of its shape when it is
not there), and a larger random-weight Qwen3-MoE. For each model, at batch 1, 8, 32 and
128 (all requests submitted at once), on prompts that share a common prefix:

- naive: one request at a time, prefix caching off, no async scheduling, one decode step
  per call (its throughput does not depend on the batch: it runs min(batch, 4) requests);
- engine, prefix caching off and on, with the engine's default scheduling;
- at batch 8 and 32 (caching on), every mix of async scheduling and multi-step decode.

Per step it reports the host time (scheduling, input packing, dispatch, output handling)
and the time the host waited for the device (without async scheduling, the device time
of the step), from `EngineCore.counters()`. It also reports the XLA compilations after
warm-up (must be 0) and the start-up time.

    python scripts/bench_offline.py [--model DIR] [--max-tokens 32] [--prompt-len 64]
        [--batches 1,8,32,128] [--out bench_results/offline.json]
    python scripts/bench_offline.py --compare-hf [...]   # against transformers: compare_hf.py
    python scripts/bench_offline.py --moe-ab [--repeats 3] [...]   # dense vs sparse MoE

`--moe-ab`: the MoE experts off the GPU, dense (`JAXSERVE_MOE_EXPERTS=dense`, every token
through every expert) against sparse (`jaxserve.models.moe_sparse`, the default): one
engine of each per model in this process, and per batch the default engine row
(prefix caching on) of each, alternated `--repeats` times; prints the median tok/s of
each and sparse/dense.

With --ab, it instead builds two engines of the demo model, "old" (the gather-everything
reference attention, JAXSERVE_CPU_ATTENTION=reference, and the sampler's full path,
JAXSERVE_SAMPLER=full, both read when the steps are traced) and "new" (the defaults;
the old one also without the R = 1 decode bucket, step_shapes.SINGLE_ROW_DECODE_BUCKET),
and runs each batch --repeats times on each, interleaved (old, new, old, new, ...), in
the default scheduling mode with prefix caching on; it prints medians.

Prints a table; writes JSON. Requests are greedy with ignore_eos, so every request
produces exactly --max-tokens tokens.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import platform
import random
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402

from jaxserve.config import DEMO_MODEL_DIR, CacheConfig, EngineConfig, SchedulerConfig  # noqa: E402
from jaxserve.ipc import EngineRequest  # noqa: E402

# The demo model's shape (scripts/train_tiny_moe.py) and a larger one that still runs on a
# 2-core CPU: 4x the layers' width budget, twice the experts.
DEMO_SHAPE = dict(
    vocab_size=4096, hidden_size=128, moe_intermediate_size=256, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8,
    num_experts_per_tok=2,
)  # fmt: skip
LARGE_SHAPE = dict(
    vocab_size=8192, hidden_size=256, moe_intermediate_size=256, num_hidden_layers=6,
    num_attention_heads=8, num_key_value_heads=2, head_dim=32, num_experts=16,
    num_experts_per_tok=2,
)  # fmt: skip
MODES = [(False, 1), (True, 1), (False, 4), (True, 4)]  # (async scheduling, decode steps)


def write_random_checkpoint(path: Path, shape: dict, max_position_embeddings: int) -> Path:
    """A Qwen3-MoE HF folder (config.json, model.safetensors) with random weights."""
    import jax.numpy as jnp
    from flax import nnx

    from jaxserve.models.config import ModelConfig
    from jaxserve.models.loader import save_hf_weights
    from jaxserve.models.registry import model_class

    hf = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "intermediate_size": 2 * shape["moe_intermediate_size"],
        "hidden_act": "silu",
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "norm_topk_prob": True,
        "tie_word_embeddings": False,
        "eos_token_id": None,
        **shape,
    }
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(hf))
    config = ModelConfig.from_hf(hf)
    save_hf_weights(model_class(config.architecture)(config, jnp.float32, rngs=nnx.Rngs(0)), path)
    return path


def shared_prefix_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """n prompts of `length` tokens: a common 3/4 prefix, then a random suffix each."""
    rng = random.Random(seed)
    prefix = [rng.randrange(vocab) for _ in range(3 * length // 4)]
    return [prefix + [rng.randrange(vocab) for _ in range(length - len(prefix))] for _ in range(n)]


@dataclass
class Run:
    model: str
    kind: str
    batch: int
    async_scheduling: bool
    decode_steps: int
    prefix_caching: bool
    requests: int
    output_tokens: int
    seconds: float
    steps: int
    host_ms_per_step: float
    device_ms_per_step: float

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds


def configure(engine, async_scheduling: bool, decode_steps: int, prefix_caching: bool) -> None:
    """Switch the scheduling mode of an idle engine (decode_steps: 1 or the compiled one)
    and start from an empty prefix cache."""
    engine.async_scheduling = async_scheduling
    engine.scheduler.num_decode_steps = decode_steps
    engine.block_manager.enable_prefix_caching = prefix_caching
    engine.block_manager.reset_prefix_cache()


def run_batch(engine, prompts: list[list[int]], max_tokens: int, one_at_a_time: bool):
    """Generate for every prompt; returns (output tokens, seconds, steps, host s, device s)."""
    sampling = dict(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    c0 = engine.counters()
    start = time.perf_counter()
    tokens = 0
    groups = [[p] for p in prompts] if one_at_a_time else [prompts]
    for group in groups:
        for p in group:
            rid = f"b{run_batch.next_id}"
            run_batch.next_id += 1
            engine.add_request(EngineRequest(rid, np.asarray(p, np.int32), dict(sampling)))
        while engine.has_work():
            for out in engine.step():
                if out.error:
                    raise RuntimeError(out.error)
                tokens += len(out.new_token_ids)
    seconds = time.perf_counter() - start
    c1 = engine.counters()
    return (
        tokens,
        seconds,
        c1.num_steps - c0.num_steps,
        c1.host_time_s - c0.host_time_s,
        c1.device_time_s - c0.device_time_s,
    )


run_batch.next_id = 0


def bench_model(name: str, model_dir: str, args) -> tuple[list[Run], dict]:
    from jaxserve.engine.core import EngineCore

    config = EngineConfig(
        model=model_dir,
        cache=CacheConfig(block_size=16),
        scheduler=SchedulerConfig(
            max_num_seqs=64,
            max_num_batched_tokens=512,
            max_model_len=args.max_model_len,
            num_decode_steps=4,
        ),
        compilation_cache_dir=args.compilation_cache_dir,
    )
    start = time.perf_counter()
    engine = EngineCore(config)
    info = {
        "startup_s": time.perf_counter() - start,
        "compile_s": engine.compile_time_s,
        "num_executables": len(engine.runner.buckets()),
    }
    default_mode = (engine.async_scheduling, SchedulerConfig().num_decode_steps)
    vocab = engine.model_config.vocab_size
    # Warm-up: every executable once (start-up compiled them; this warms caches).
    configure(engine, True, 4, True)
    run_batch(engine, shared_prefix_prompts(8, args.prompt_len, vocab, 0), 8, False)
    runs: list[Run] = []

    def record(kind, batch, mode, caching, prompts, one_at_a_time=False):
        configure(engine, mode[0], mode[1], caching)
        tokens, seconds, steps, host, device = run_batch(
            engine, prompts, args.max_tokens, one_at_a_time
        )
        run = Run(
            name, kind, batch, mode[0], mode[1], caching, len(prompts), tokens, seconds,
            steps, 1e3 * host / max(steps, 1), 1e3 * device / max(steps, 1),
        )  # fmt: skip
        runs.append(run)
        print_row(run, flush=True)

    for batch in args.batches:
        prompts = shared_prefix_prompts(batch, args.prompt_len, vocab, seed=batch)
        record("naive", batch, (False, 1), False, prompts[: min(batch, 4)], one_at_a_time=True)
        record("engine", batch, default_mode, False, prompts)
        record("engine", batch, default_mode, True, prompts)
        if batch in (8, 32):
            for mode in MODES:
                if mode != default_mode:
                    record("mode", batch, mode, True, prompts)
    info["compilations_after_warmup"] = engine.num_compilations
    return runs, info


def bench_moe_ab(name: str, model_dir: str, args) -> tuple[list[Run], dict]:
    """Dense vs sparse MoE experts (see the module docstring): rows of kind 'dense' and
    'sparse', `args.repeats` of each per batch, interleaved."""
    from jaxserve.engine.core import EngineCore
    from jaxserve.kernels import dispatch

    config = EngineConfig(
        model=model_dir,
        cache=CacheConfig(block_size=16),
        scheduler=SchedulerConfig(
            max_num_seqs=64, max_num_batched_tokens=512, max_model_len=args.max_model_len,
            num_decode_steps=4,
        ),
        compilation_cache_dir=args.compilation_cache_dir,
    )  # fmt: skip
    engines = {}
    start = time.perf_counter()
    for variant in (dispatch.MOE_DENSE, dispatch.MOE_SPARSE):
        # Read when the step functions are traced, i.e. while the engine starts.
        os.environ[dispatch.MOE_ENV_VAR] = variant
        engines[variant] = EngineCore(config)
    del os.environ[dispatch.MOE_ENV_VAR]
    startup_s = time.perf_counter() - start
    sparse = engines[dispatch.MOE_SPARSE]
    default_mode = (sparse.async_scheduling, SchedulerConfig().num_decode_steps)
    vocab = engines[dispatch.MOE_SPARSE].model_config.vocab_size
    for engine in engines.values():
        configure(engine, True, 4, True)
        run_batch(engine, shared_prefix_prompts(8, args.prompt_len, vocab, 0), 8, False)
    # The compile counter is per process: count from here, after both engines warmed up.
    compiles_before = engines[dispatch.MOE_SPARSE].num_compilations
    runs: list[Run] = []
    for batch in args.batches:
        prompts = shared_prefix_prompts(batch, args.prompt_len, vocab, seed=batch)
        for _ in range(args.repeats):
            for variant, engine in engines.items():
                configure(engine, default_mode[0], default_mode[1], True)
                tokens, seconds, steps, host, device = run_batch(
                    engine, prompts, args.max_tokens, False
                )
                run = Run(
                    name, variant, batch, default_mode[0], default_mode[1], True, len(prompts),
                    tokens, seconds, steps, 1e3 * host / max(steps, 1),
                    1e3 * device / max(steps, 1),
                )  # fmt: skip
                runs.append(run)
                print_row(run, flush=True)
    compiles = engines[dispatch.MOE_SPARSE].num_compilations - compiles_before
    info = {"compilations_after_warmup": compiles, "startup_s": startup_s}
    info["num_executables"] = len(engines[dispatch.MOE_SPARSE].runner.buckets())
    info["compile_s"] = sum(e.compile_time_s for e in engines.values())
    return runs, info


def print_moe_ab(runs: list[Run]) -> None:
    """Median tok/s of dense and sparse per (model, batch), and sparse/dense."""
    import statistics

    print(f"\n{'model':<8} {'batch':>5} {'dense tok/s':>11} {'sparse tok/s':>12} {'ratio':>7}")
    for model, batch in dict.fromkeys((r.model, r.batch) for r in runs):
        med = {
            kind: statistics.median(
                r.tokens_per_s for r in runs if (r.model, r.batch, r.kind) == (model, batch, kind)
            )
            for kind in ("dense", "sparse")
        }
        ratio = med["sparse"] / med["dense"]
        print(f"{model:<8} {batch:>5} {med['dense']:>11.1f} {med['sparse']:>12.1f} {ratio:>6.2f}x")


HEADER = (
    f"{'model':<8} {'kind':<7} {'batch':>5} {'async':>5} {'k':>2} {'cache':>5} "
    f"{'tok/s':>8} {'steps':>6} {'host ms/step':>12} {'device ms/step':>14}"
)


def print_row(r: Run, flush: bool = False) -> None:
    print(
        f"{r.model:<8} {r.kind:<7} {r.batch:>5} {'on' if r.async_scheduling else 'off':>5} "
        f"{r.decode_steps:>2} {'on' if r.prefix_caching else 'off':>5} {r.tokens_per_s:>8.1f} "
        f"{r.steps:>6} {r.host_ms_per_step:>12.2f} {r.device_ms_per_step:>14.2f}",
        flush=flush,
    )


AB_ENV = {"JAXSERVE_CPU_ATTENTION": "reference", "JAXSERVE_SAMPLER": "full"}


def bench_ab(model_dir: str, args) -> dict:
    """Interleaved old/new runs (see the module docstring); returns the JSON record."""
    import statistics

    from jaxserve.engine import step_shapes
    from jaxserve.engine.core import EngineCore

    config = EngineConfig(
        model=model_dir,
        cache=CacheConfig(block_size=16),
        scheduler=SchedulerConfig(
            max_num_seqs=64, max_num_batched_tokens=512, max_model_len=args.max_model_len
        ),
        compilation_cache_dir=args.compilation_cache_dir,
    )
    engines, info = {}, {}
    for variant in ("old", "new"):
        saved = {k: os.environ.get(k) for k in AB_ENV}
        # The old engine also pads batch 1 to MIN_DECODE_ROWS (no R = 1 decode bucket).
        step_shapes.SINGLE_ROW_DECODE_BUCKET = variant == "new"
        if variant == "old":
            os.environ.update(AB_ENV)
        else:
            for k in AB_ENV:
                os.environ.pop(k, None)
        try:
            start = time.perf_counter()
            engine = EngineCore(config)
            info[variant] = {
                "startup_s": time.perf_counter() - start,
                "num_executables": len(engine.runner.buckets()),
            }
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        vocab = engine.model_config.vocab_size
        configure(engine, True, 4, True)
        run_batch(engine, shared_prefix_prompts(8, args.prompt_len, vocab, 0), 8, False)
        engines[variant] = engine
    # The compile counter is per process: the old engine's count grew by the new one's
    # start-up; count from here on for both.
    compiles_before = {variant: e.num_compilations for variant, e in engines.items()}
    mode = (engines["new"].async_scheduling, config.scheduler.num_decode_steps)
    print(
        f"{'batch':>5} {'variant':>7} {'tok/s':>8} {'device ms/step':>14} {'host ms/step':>12} "
        f"{'steps':>6}  uptime"
    )
    rows = []
    for batch in args.batches:
        prompts = shared_prefix_prompts(batch, args.prompt_len, vocab, seed=batch)
        samples = {"old": [], "new": []}
        for _ in range(args.repeats):
            for variant, engine in engines.items():
                configure(engine, mode[0], mode[1], True)
                tokens, seconds, steps, host, device = run_batch(
                    engine, prompts, args.max_tokens, False
                )
                samples[variant].append(
                    (tokens / seconds, 1e3 * device / steps, 1e3 * host / steps, steps)
                )
        load = os.getloadavg()[0]
        for variant, runs in samples.items():
            tok_s, dev, host = (statistics.median(r[i] for r in runs) for i in range(3))
            rows.append(
                dict(batch=batch, variant=variant, tokens_per_s=tok_s, device_ms_per_step=dev,
                     host_ms_per_step=host, steps=runs[0][3], load1=load, runs=runs)
            )  # fmt: skip
            print(
                f"{batch:>5} {variant:>7} {tok_s:>8.1f} {dev:>14.2f} {host:>12.2f} "
                f"{runs[0][3]:>6}  load {load:.2f}",
                flush=True,
            )
        old, new = rows[-2]["tokens_per_s"], rows[-1]["tokens_per_s"]
        print(f"{batch:>5} {'new/old':>7} {new / old:>8.2f}x", flush=True)
    for variant, engine in engines.items():
        compiles = engine.num_compilations - compiles_before[variant]
        info[variant]["compilations_after_warmup"] = compiles
        print(
            f"# {variant}: {info[variant]['num_executables']} executables, start-up "
            f"{info[variant]['startup_s']:.1f} s, compilations during the runs: {compiles}"
        )
    return {"info": info, "rows": rows}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if "--compare-hf" in argv:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from compare_hf import main as compare_main

        compare_main([a for a in argv if a != "--compare-hf"])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="demo-sized model folder (default: demo)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=256)
    parser.add_argument("--batches", default="1,8,32,128")
    parser.add_argument("--models", default="demo,large", help="which of demo,large to run")
    parser.add_argument("--compilation-cache-dir", default=EngineConfig().compilation_cache_dir)
    parser.add_argument("--out", default=None, help="default bench_results/offline[_ab].json")
    parser.add_argument("--ab", action="store_true", help="old vs new attention and sampler")
    parser.add_argument("--repeats", type=int, default=3, help="runs per A/B variant")
    parser.add_argument("--moe-ab", action="store_true", help="dense vs sparse MoE experts")
    args = parser.parse_args(argv)
    args.batches = [int(b) for b in args.batches.split(",")]
    args.out = args.out or (
        "bench_results/offline_ab.json" if args.ab else "bench_results/offline.json"
    )

    tmp = Path(tempfile.mkdtemp(prefix="jaxserve_bench_"))
    # The random checkpoints (~90 MB a run) go with the process: runs left them behind.
    atexit.register(shutil.rmtree, tmp, ignore_errors=True)
    models = {}
    demo = Path(args.model) if args.model else DEMO_MODEL_DIR
    if (demo / "config.json").is_file():
        models["demo"] = str(demo)
    else:
        print(f"# {demo} has no model: using a random checkpoint of the demo's shape", flush=True)
        models["demo"] = str(write_random_checkpoint(tmp / "demo", DEMO_SHAPE, 1024))
    print(
        f"# {platform.node()}: {os.cpu_count()} CPUs, {platform.processor() or platform.machine()}"
    )
    print(f"# load average at start: {os.getloadavg()}")
    if args.ab:
        result = {
            "machine": {"node": platform.node(), "cpus": os.cpu_count(), "python": sys.version},
            "args": {k: v for k, v in vars(args).items()},
            **bench_ab(models["demo"], args),
        }
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1))
        print(f"# wrote {out}")
        return
    models["large"] = str(write_random_checkpoint(tmp / "large", LARGE_SHAPE, 2048))
    print(HEADER, flush=True)
    all_runs, infos = [], {}
    for name in args.models.split(","):
        runs, info = (bench_moe_ab if args.moe_ab else bench_model)(name, models[name], args)
        all_runs += runs
        infos[name] = info
    if args.moe_ab:
        print_moe_ab(all_runs)
    print(f"# load average at end: {os.getloadavg()}")
    print()
    for name, info in infos.items():
        print(
            f"# {name}: {info['num_executables']} executables, start-up {info['startup_s']:.1f} s "
            f"(compile {info['compile_s']:.1f} s), compilations after warm-up: "
            f"{info['compilations_after_warmup']}"
        )
    result = {
        "machine": {"node": platform.node(), "cpus": os.cpu_count(), "python": sys.version},
        "args": {k: v for k, v in vars(args).items()},
        "models": {name: {"dir": models[name], **infos.get(name, {})} for name in models},
        "runs": [dict(vars(r), tokens_per_s=r.tokens_per_s) for r in all_runs],
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"# wrote {out}")


if __name__ == "__main__":
    main()
