"""DeepSeek-V3 measurements (issue 15): the latent KV cache, offline throughput, FP8 loads.

    python scripts/bench_deepseek.py kv [--pool-gib 64] [--block-size 16]
    python scripts/bench_deepseek.py offline [--batches 1,8,32] [--repeats 3]
    python scripts/bench_deepseek.py write-fp8 DIR [--shards 4]
    python scripts/bench_load.py --model DIR        # then: load time and peak host memory

`kv`: for DeepSeek-V3's published shape (61 layers, 128 heads, kv_lora_rank 512,
qk_rope_head_dim 64, qk_nope_head_dim 128, v_head_dim 128), KV bytes per token and the
tokens a fixed pool holds, from the engine's own sizing (`kv_sizing.kv_block_bytes` over
the model's `kv_layout()`): the MLA latent against the same model's per-head K/V
(K = nope + rope = 192, V = 128 per head, what a non-MLA cache of the expanded
attention would hold), bfloat16, per device at tp 1 and tp 8 (per-head K/V split by
head over tp; the latent is replicated).

`offline`: output tokens/s of `EngineCore` on the CPU, a small random DeepSeek-V3 against
a Qwen3-MoE of the same hidden size, layers, heads, experts, top-k and expert width
(DeepSeek adds its shared expert, MLA and the grouped gate; parameter counts printed);
per batch the two engines alternate `--repeats` times and the median is reported.

`write-fp8`: a random DeepSeek-V3 checkpoint (about 0.4 GB in float32) in DeepSeek's
FP8 format: float8_e4m3fn linear weights with 128x128 `weight_scale_inv` blocks, sharded
over `--shards` safetensors files with an index, and one MTP layer.

Prints tables; writes JSON under bench_results/.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench_results"

DEEPSEEK_V3 = dict(
    architectures=["DeepseekV3ForCausalLM"],
    vocab_size=129280,
    hidden_size=7168,
    intermediate_size=18432,
    moe_intermediate_size=2048,
    num_hidden_layers=61,
    num_attention_heads=128,
    num_key_value_heads=128,
    n_shared_experts=1,
    n_routed_experts=256,
    routed_scaling_factor=2.5,
    kv_lora_rank=512,
    q_lora_rank=1536,
    qk_rope_head_dim=64,
    v_head_dim=128,
    qk_nope_head_dim=128,
    n_group=8,
    topk_group=4,
    num_experts_per_tok=8,
    first_k_dense_replace=3,
    norm_topk_prob=True,
    max_position_embeddings=163840,
    rope_scaling={
        "type": "yarn",
        "factor": 40,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
    rope_theta=10000,
)

# Small random models for the CPU (offline tok/s) and the FP8 load.
SMALL = dict(
    vocab_size=32000,
    hidden_size=512,
    intermediate_size=1024,
    moe_intermediate_size=256,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_experts_per_tok=4,
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)
SMALL_DEEPSEEK = dict(
    SMALL,
    architectures=["DeepseekV3ForCausalLM"],
    n_routed_experts=64,
    n_shared_experts=1,
    n_group=8,
    topk_group=4,
    first_k_dense_replace=0,
    q_lora_rank=256,
    kv_lora_rank=128,
    qk_nope_head_dim=64,
    qk_rope_head_dim=32,
    v_head_dim=64,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    rope_theta=10000.0,
)
SMALL_QWEN = dict(
    SMALL,
    architectures=["Qwen3MoeForCausalLM"],
    num_key_value_heads=8,
    head_dim=64,
    num_experts=64,
    rope_theta=1e6,
    norm_topk_prob=True,
)


def _save(result: dict, name: str) -> None:
    RESULTS.mkdir(exist_ok=True)
    result = {"uptime": _uptime(), "machine": platform.platform(), **result}
    (RESULTS / name).write_text(json.dumps(result, indent=2))
    print(f"wrote {RESULTS / name}")


def _uptime() -> str:
    return os.popen("uptime").read().strip()


# ----- kv -----------------------------------------------------------------------------------


def cmd_kv(args) -> None:
    import jax.numpy as jnp

    from jaxserve.engine.kv_sizing import kv_block_bytes, kv_token_bytes
    from jaxserve.models.base import KVLayout
    from jaxserve.models.config import ModelConfig
    from jaxserve.models.mla import mla_kv_layout

    c = ModelConfig.from_hf(DEEPSEEK_V3)
    m = c.mla
    layouts = {
        "MLA latent": mla_kv_layout(m),
        "per-head K/V": KVLayout(
            c.num_attention_heads, m.qk_head_dim, c.num_attention_heads, m.v_head_dim
        ),
    }
    dtype = jnp.bfloat16
    pool = int(args.pool_gib * 2**30)
    rows = []
    print(f"DeepSeek-V3 shape, bfloat16, block_size {args.block_size}, pool {args.pool_gib} GiB")
    print(f"uptime: {_uptime()}")
    print(f"{'layout':<14} {'B/token':>10} {'KiB/token':>10} {'tp':>3} {'tokens/pool/device':>20}")
    for name, layout in layouts.items():
        per_token = kv_token_bytes(c, dtype, layout)
        for tp in (1, 8):
            shards = tp if layout.shard_heads else 1
            per_block = kv_block_bytes(c, args.block_size, dtype, layout) // shards
            tokens = (pool // per_block) * args.block_size
            rows.append(dict(layout=name, bytes_per_token=per_token, tp=tp, tokens_per_pool=tokens))
            print(f"{name:<14} {per_token:>10} {per_token / 1024:>10.1f} {tp:>3} {tokens:>20,}")
    ratio = rows[2]["bytes_per_token"] / rows[0]["bytes_per_token"]
    print(f"per-head K/V / latent bytes per token: {ratio:.1f}x")
    _save(
        dict(pool_gib=args.pool_gib, block_size=args.block_size, rows=rows, ratio=ratio),
        "deepseek_kv.json",
    )


# ----- random checkpoints ----------------------------------------------------------------


def write_random(config: dict, path: Path) -> int:
    """A random-weight HF folder of `config`; returns the parameter count."""
    import jax.numpy as jnp
    from flax import nnx

    from jaxserve.models.config import ModelConfig
    from jaxserve.models.loader import save_hf_weights
    from jaxserve.models.registry import model_class

    path.mkdir(parents=True, exist_ok=True)
    mc = ModelConfig.from_hf(config)
    model = model_class(mc.architecture)(mc, jnp.float32, rngs=nnx.Rngs(0))
    save_hf_weights(model, path)
    (path / "config.json").write_text(json.dumps(config))
    params = nnx.state(model, nnx.Param)
    return sum(int(np.prod(v.get_value().shape)) for _, v in nnx.to_flat_state(params))


def cmd_write_fp8(args) -> None:
    import ml_dtypes
    from safetensors import safe_open

    out = Path(args.dir)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "src"
        config = {**SMALL_DEEPSEEK, "num_nextn_predict_layers": 1}
        write_random(SMALL_DEEPSEEK, src)
        with safe_open(str(src / "model.safetensors"), framework="np") as f:
            tensors = {n: f.get_tensor(n) for n in f.keys()}
    block = 128
    quantized: dict[str, np.ndarray] = {}
    for name, t in tensors.items():
        if t.ndim != 2 or any(s in name for s in ("embed_tokens", "lm_head", "mlp.gate.weight")):
            quantized[name] = t
            continue
        rows, cols = t.shape
        nr, nc = -(-rows // block), -(-cols // block)
        padded = np.zeros((nr * block, nc * block), np.float32)
        padded[:rows, :cols] = t
        amax = np.abs(padded.reshape(nr, block, nc, block)).max(axis=(1, 3))
        scale = np.maximum(amax, 1e-12).astype(np.float32) / 448.0
        full = np.repeat(np.repeat(scale, block, 0), block, 1)[:rows, :cols]
        quantized[name] = (t / full).astype(ml_dtypes.float8_e4m3fn)
        quantized[name + "_scale_inv"] = scale
    h, layer = SMALL_DEEPSEEK["hidden_size"], SMALL_DEEPSEEK["num_hidden_layers"]
    quantized[f"model.layers.{layer}.eh_proj.weight"] = np.zeros((h, 2 * h), np.float32)
    out.mkdir(parents=True, exist_ok=True)
    names = sorted(quantized)
    weight_map = {}
    for s in range(args.shards):
        file = f"model-{s + 1:05d}-of-{args.shards:05d}.safetensors"
        part = {n: quantized[n] for n in names[s :: args.shards]}
        # safetensors' NumPy writer takes no FP8: store FP8 bytes under their own dtype.
        _save_with_fp8(part, out / file)
        weight_map.update(dict.fromkeys(part, file))
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    quant = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}
    config["quantization_config"] = {**quant, "weight_block_size": [block, block]}
    (out / "config.json").write_text(json.dumps(config))
    size = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    print(f"wrote {out}: {len(names)} tensors, {args.shards} shards, {size / 2**20:.0f} MiB")


def _save_with_fp8(tensors: dict[str, np.ndarray], path: Path) -> None:
    """A safetensors file (the format: 8-byte header size, JSON header, raw data) that
    may hold ml_dtypes FP8 arrays, which safetensors' NumPy writer refuses."""
    import struct

    import ml_dtypes

    names = {np.dtype(np.float32): "F32", np.dtype(ml_dtypes.float8_e4m3fn): "F8_E4M3"}
    header, offset, blobs = {}, 0, []
    for name, t in tensors.items():
        data = np.ascontiguousarray(t).tobytes()
        header[name] = {
            "dtype": names[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + len(data)],
        }
        offset += len(data)
        blobs.append(data)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for b in blobs:
            f.write(b)


# ----- offline ------------------------------------------------------------------------------


def _engine(model_dir: Path, args):
    from jaxserve.config import CacheConfig, EngineConfig, SchedulerConfig
    from jaxserve.engine.core import EngineCore

    return EngineCore(
        EngineConfig(
            model=str(model_dir),
            cache=CacheConfig(block_size=16, num_blocks=1 + args.max_batch * 8),
            scheduler=SchedulerConfig(
                max_num_seqs=args.max_batch, max_num_batched_tokens=256, max_model_len=128
            ),
        )
    )


def _tok_s(engine, batch: int, args, seed: int) -> float:
    from jaxserve.ipc import EngineRequest

    rng = np.random.default_rng(seed)
    vocab = engine.model_config.vocab_size
    sampling = dict(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    start = time.perf_counter()
    for i in range(batch):
        prompt = rng.integers(0, vocab, args.prompt_len).astype(np.int32)
        engine.add_request(EngineRequest(f"b{seed}-{i}", prompt, sampling))
    tokens = 0
    while engine.has_work():
        tokens += sum(len(o.new_token_ids) for o in engine.step())
    return tokens / (time.perf_counter() - start)


def cmd_offline(args) -> None:
    batches = [int(b) for b in args.batches.split(",")]
    args.max_batch = max(batches)
    with tempfile.TemporaryDirectory() as tmp:
        sizes = {
            "deepseek_v3": write_random(SMALL_DEEPSEEK, Path(tmp) / "ds"),
            "qwen3_moe": write_random(SMALL_QWEN, Path(tmp) / "qwen"),
        }
        engines = {"deepseek_v3": _engine(Path(tmp) / "ds", args)}
        engines["qwen3_moe"] = _engine(Path(tmp) / "qwen", args)
    for engine in engines.values():  # warm-up
        _tok_s(engine, 1, args, 0)
    print(f"uptime: {_uptime()}")
    print(f"params: {', '.join(f'{k} {v / 1e6:.1f} M' for k, v in sizes.items())}")
    print(f"{'batch':>5} {'deepseek_v3 tok/s':>18} {'qwen3_moe tok/s':>16} {'ratio':>6}")
    rows = []
    for batch in batches:
        runs: dict[str, list[float]] = {k: [] for k in engines}
        for r in range(args.repeats):
            for name, engine in engines.items():  # interleaved A/B
                runs[name].append(_tok_s(engine, batch, args, 100 * batch + r))
        med = {k: statistics.median(v) for k, v in runs.items()}
        ratio = med["deepseek_v3"] / med["qwen3_moe"]
        rows.append(dict(batch=batch, median_tok_s=med, runs=runs, ratio=ratio))
        print(f"{batch:>5} {med['deepseek_v3']:>18.1f} {med['qwen3_moe']:>16.1f} {ratio:>6.2f}")
    print(f"uptime: {_uptime()}")
    _save(
        dict(
            params=sizes,
            prompt_len=args.prompt_len,
            max_tokens=args.max_tokens,
            repeats=args.repeats,
            rows=rows,
        ),
        "deepseek_offline.json",
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    kv = sub.add_parser("kv")
    kv.add_argument("--pool-gib", type=float, default=64.0)
    kv.add_argument("--block-size", type=int, default=16)
    off = sub.add_parser("offline")
    off.add_argument("--batches", default="1,8")
    off.add_argument("--repeats", type=int, default=3)
    off.add_argument("--prompt-len", type=int, default=64)
    off.add_argument("--max-tokens", type=int, default=32)
    fp8 = sub.add_parser("write-fp8")
    fp8.add_argument("dir")
    fp8.add_argument("--shards", type=int, default=4)
    args = parser.parse_args()
    {"kv": cmd_kv, "offline": cmd_offline, "write-fp8": cmd_write_fp8}[args.cmd](args)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
