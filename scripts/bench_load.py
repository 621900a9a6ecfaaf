"""Loading benchmarks: safetensors vs the Orbax checkpoint of `jaxserve convert`; prints a table.

    .venv/bin/python scripts/bench_load.py [--model HF_DIR] [--mesh dp=2,tp=4]

Without --model, a random Qwen3-MoE checkpoint (about 0.5 GB in float32, per-expert
tensors as on the Hub) is written to a temporary folder first. Each load runs in a fresh
process on 8 emulated CPU devices and reports:

- wall time to a model with every parameter placed on its shards;
- peak host memory of NumPy buffers during the load (tracemalloc), the part still held
  afterwards (on the CPU a device array may alias the NumPy buffer it was made from, so
  "held" is model data, not a leak) and the difference, the transient staging memory;
- the largest single tensor of the model, for comparison: the loader never holds more
  than a few tensors at once, never the whole model.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SYNTHETIC = dict(
    architectures=["Qwen3MoeForCausalLM"],
    vocab_size=32000,
    hidden_size=512,
    intermediate_size=1024,
    moe_intermediate_size=256,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=8,
    head_dim=64,
    num_experts=64,
    num_experts_per_tok=4,
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
    rope_theta=1e6,
    norm_topk_prob=True,
    tie_word_embeddings=False,
)


def write_synthetic(path: Path) -> None:
    import jax.numpy as jnp
    from flax import nnx

    from jaxserve.models.config import ModelConfig
    from jaxserve.models.loader import save_hf_weights
    from jaxserve.models.qwen3_moe import Qwen3MoeForCausalLM

    model = Qwen3MoeForCausalLM(ModelConfig.from_hf(SYNTHETIC), jnp.float32, rngs=nnx.Rngs(0))
    save_hf_weights(model, path)
    (path / "config.json").write_text(json.dumps(SYNTHETIC))


def worker(model_dir: str, mesh_text: str) -> None:
    import jax
    from flax import nnx

    from jaxserve.config import MeshConfig
    from jaxserve.sharding.load import load_sharded_model
    from jaxserve.sharding.mesh import build_mesh_from_config

    mesh = build_mesh_from_config(MeshConfig.parse(mesh_text))
    tracemalloc.start()
    start = time.perf_counter()
    model, _ = load_sharded_model(model_dir, mesh)
    params = nnx.state(model, nnx.Param)
    jax.block_until_ready(params)
    seconds = time.perf_counter() - start
    held, peak = tracemalloc.get_traced_memory()
    sizes = [v.get_value().nbytes for _, v in nnx.to_flat_state(params)]
    print(
        json.dumps(
            {
                "seconds": seconds,
                "peak_mib": peak / 2**20,
                "held_mib": held / 2**20,
                "largest_mib": max(sizes) / 2**20,
                "model_mib": sum(sizes) / 2**20,
            }
        )
    )


def _run(model_dir: Path, mesh: str) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    out = subprocess.run(
        [sys.executable, __file__, "--worker", str(model_dir), "--mesh", mesh],
        env=env,
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="HF folder (default: a synthetic one)")
    parser.add_argument("--mesh", default="dp=2,tp=4")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.mesh)
        return
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = Path(args.model) if args.model else Path(tmp) / "hf"
        if not args.model:
            hf_dir.mkdir()
            write_synthetic(hf_dir)
        orbax_dir = Path(tmp) / "orbax"
        convert = subprocess.run(
            [
                sys.executable,
                "-m",
                "jaxserve.cli",
                "convert",
                "--model",
                str(hf_dir),
                "--out",
                str(orbax_dir),
                "--mesh",
                args.mesh,
            ],
            env=dict(
                os.environ,
                JAX_PLATFORMS="cpu",
                PYTHONPATH=str(ROOT),
                XLA_FLAGS="--xla_force_host_platform_device_count=8",
            ),
            check=True,
            capture_output=True,
            text=True,
        )
        print(convert.stdout.strip())
        rows = {"safetensors": _run(hf_dir, args.mesh), "orbax": _run(orbax_dir, args.mesh)}
    print(f"\nmesh {args.mesh}, model {rows['safetensors']['model_mib']:.0f} MiB float32")
    print("| source | load s | peak NumPy MiB | still held MiB | transient MiB | largest MiB |")
    print("|---|---|---|---|---|---|")
    for name, r in rows.items():
        cells = [f"{r['seconds']:.2f}", f"{r['peak_mib']:.1f}", f"{r['held_mib']:.1f}"]
        cells += [f"{r['peak_mib'] - r['held_mib']:.1f}", f"{r['largest_mib']:.1f}"]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
