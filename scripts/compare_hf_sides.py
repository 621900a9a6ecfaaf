"""The sides of `compare_hf.py`, each run in its own worker process (this file).

A side (`JaxserveSide`, `TransformersSide`, compare_llama_cpp's `LlamaCppSide`) loads
one checkpoint and answers two commands: `generate` (greedy tokens for a batch of equal
length prompts, timed) and `ceiling` (its f32 matmul FLOP/s, the utilisation's
denominator). `Worker` starts `python compare_hf_sides.py --side S ...` and drives it
with one JSON line per command on stdin, one JSON line back on stdout (`worker_main`).
The torch worker runs with OMP_WAIT_POLICY=PASSIVE, llama.cpp with OpenMP's default:
why, compare_hf.py's docstring.

Only the standard library at the top: the llama.cpp worker runs under an interpreter
that has neither jax nor torch.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _matmul_ceiling_jax(n: int = 1024, reps: int = 10) -> float:
    import jax
    import jax.numpy as jnp

    a = jnp.ones((n, n), jnp.float32)
    f = jax.jit(lambda x, y: x @ y)
    f(a, a).block_until_ready()
    best = min(_timed(lambda: f(a, a).block_until_ready()) for _ in range(reps))
    return 2 * n**3 / best


def _matmul_ceiling_torch(n: int = 1024, reps: int = 10) -> float:
    import torch

    a = torch.ones((n, n), dtype=torch.float32)
    a @ a
    best = min(_timed(lambda: a @ a) for _ in range(reps))
    return 2 * n**3 / best


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


class JaxserveSide:
    def __init__(self, model: str, max_batch: int, max_model_len: int):
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        from jaxserve import LLM
        from jaxserve.config import DEMO_MODEL_DIR

        self.llm = LLM(
            model=model,
            tokenizer=DEMO_MODEL_DIR,
            max_num_seqs=max_batch,
            max_model_len=max_model_len,
        )

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        from jaxserve import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        return [o.token_ids for o in self.llm.generate(prompts, params)]

    ceiling = staticmethod(_matmul_ceiling_jax)


class TransformersSide:
    def __init__(self, model: str, max_batch: int, max_model_len: int):
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(os.cpu_count() or 1)
        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        torch = self.torch
        ids = torch.tensor(prompts, dtype=torch.long)  # equal lengths: no padding
        with torch.inference_mode():
            out = self.model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                do_sample=False,
                pad_token_id=0,
            )
        return out[:, ids.shape[1] :].tolist()

    ceiling = staticmethod(_matmul_ceiling_torch)


def worker_main(side: str, model: str, max_batch: int, max_model_len: int) -> None:
    """Answer one JSON command per stdin line with one JSON line on stdout."""
    out = sys.stdout
    sys.stdout = sys.stderr  # library chatter must not corrupt the protocol
    if side == "llama.cpp":  # under --llama-python, which has neither jax nor torch
        sys.path.insert(0, str(HERE))
        from compare_llama_cpp import LlamaCppSide as cls
    else:
        cls = {"jaxserve": JaxserveSide, "transformers": TransformersSide}[side]
    impl = cls(model, max_batch, max_model_len)
    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "ceiling":
            result = {"flops_per_s": impl.ceiling()}
        else:
            start = time.perf_counter()
            tokens = impl.generate(cmd["prompts"], cmd["max_tokens"])
            result = {"seconds": time.perf_counter() - start, "tokens": tokens}
        out.write(json.dumps(result) + "\n")
        out.flush()


class Worker:
    """A worker process driven over its stdin/stdout."""

    def __init__(
        self,
        side: str,
        model: str,
        max_batch: int,
        max_model_len: int,
        python: str | None = None,
        env: dict[str, str] | None = None,
    ):
        env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", JAX_PLATFORMS="cpu", **(env or {}))
        if side == "llama.cpp":  # OpenMP's default wait policy (see the docstring)
            del env["OMP_WAIT_POLICY"]
        self.side = side
        cmd = [python or sys.executable, __file__, "--side", side, "--model", model]
        cmd += ["--max-batch", str(max_batch), "--max-model-len", str(max_model_len)]
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
        )
        self._read()

    def call(self, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker {self.side} died (exit {self.proc.wait()})")
        return json.loads(line)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--side", required=True, choices=["jaxserve", "transformers", "llama.cpp"])
    parser.add_argument("--model", required=True, help="checkpoint folder (llama.cpp: GGUF)")
    parser.add_argument("--max-batch", type=int, required=True)
    parser.add_argument("--max-model-len", type=int, required=True)
    args = parser.parse_args(argv)
    worker_main(args.side, args.model, args.max_batch, args.max_model_len)


if __name__ == "__main__":
    main()
