"""The llama.cpp column of `compare_hf.py`: llama-cpp-python on an f32 GGUF of the same
checkpoint, greedy over the same prompts (token ids), in its own worker process.

llama-cpp-python is not a dependency of this project (nor of CI): give compare_hf an
interpreter that has it (`--llama-python`) and llama.cpp's own converter
(`--llama-converter`, `convert_hf_to_gguf.py` of the llama.cpp source it was built from,
e.g. the llama-cpp-python sdist's `vendor/llama.cpp/`). Nothing of llama.cpp is copied
here; the GGUF is written into compare_hf's temporary folder.

- `make_gguf` runs the converter (under this interpreter, which has its torch and
  transformers) at f32 on a staged copy of the checkpoint, with the demo model's tokenizer
  when the folder has none (the random Qwen3-MoE has the demo's 4096-token vocabulary).
  The converter names the tokenizer's pre-tokenizer by hashing its output on a test
  string and refuses a hash it does not list, as it does the demo's own BPE; since the
  benchmark feeds token ids, only the vocabulary's structure reaches the GGUF's use, so
  `_convert_main` calls it as "default" and changes nothing else.
- `LlamaCppSide` (run by compare_hf's worker under that interpreter) decodes with the
  low-level API: per batch size a llama_context of `n_seq_max` = the batch, each
  sequence with its own f32 KV cache (the default f16 cache would round what jaxserve and
  transformers keep in f32), one sequence id per prompt, the prompts' prefill in
  `llama_decode` calls of whole prompts, then one token per sequence per call, argmax of
  each sequence's last logits; EOS is not looked at, so every prompt gets `max_tokens`.
  Threads: one per CPU, under OpenMP's default wait policy (see compare_hf's Worker).

    # llama-cpp-python, CPU only, into its own venv (not .venv):
    python3.12 -m venv /work/llama-venv && /work/llama-venv/bin/pip install numpy
    CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \\
      -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_CURL=OFF" \\
      /work/llama-venv/bin/pip install llama_cpp_python-0.3.36.tar.gz
    tar xzf llama_cpp_python-0.3.36.tar.gz -C /tmp   # for the converter
    python scripts/bench_offline.py --compare-hf --llama-python /work/llama-venv/bin/python \\
      --llama-converter /tmp/llama_cpp_python-0.3.36/vendor/llama.cpp/convert_hf_to_gguf.py
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def has_llama_cpp(python: str) -> bool:
    """Whether `python` can import llama_cpp (it loads the shared library: a broken
    build fails here, not in the middle of the comparison)."""
    probe = subprocess.run([python, "-c", "import llama_cpp"], capture_output=True)
    return probe.returncode == 0


def make_gguf(converter: str, hf_dir: Path, tokenizer_dir: Path, out: Path) -> Path:
    """An f32 GGUF of the Hugging Face checkpoint `hf_dir`, made by llama.cpp's
    `converter`; `tokenizer_dir` lends the tokenizer files `hf_dir` lacks."""
    stage = out.with_suffix(".hf")
    stage.mkdir(parents=True, exist_ok=True)
    for f in hf_dir.iterdir():
        if f.name.endswith((".json", ".safetensors")):
            (stage / f.name).symlink_to(f.resolve())
    for name in TOKENIZER_FILES:
        if not (stage / name).exists():
            shutil.copy(tokenizer_dir / name, stage / name)
    cmd = [sys.executable, __file__, "--convert", converter, str(stage)]
    cmd += ["--outtype", "f32", "--outfile", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{converter} failed on {hf_dir}:\n{done.stderr[-3000:]}")
    shutil.rmtree(stage)
    return out


def _convert_main(converter: str, argv: list[str]) -> None:
    """Run llama.cpp's converter with its pre-tokenizer check answered "default" (see the
    module docstring), importing its own `conversion` package and `gguf-py`."""
    import runpy

    conv = Path(converter).resolve()
    sys.path[:0] = [str(conv.parent), str(conv.parent / "gguf-py")]
    import conversion.base  # the converter's package, found through the path above

    conversion.base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "default"
    sys.argv = [str(conv), *argv]
    runpy.run_path(str(conv), run_name="__main__")


def prefill_chunks(num_prompts: int, prompt_len: int, n_batch: int) -> list[range]:
    """The prompts (by index) each prefill `llama_decode` call takes: whole prompts, at
    most `n_batch` tokens a call."""
    if not 0 < prompt_len <= n_batch:
        raise ValueError(f"prompts of {prompt_len} tokens: llama_decode takes 1 to {n_batch}")
    per_call = n_batch // prompt_len
    return [range(s, min(s + per_call, num_prompts)) for s in range(0, num_prompts, per_call)]


_printing = False


def _warnings_only(level: int, text: bytes, _user_data) -> None:
    """llama.cpp's log, warnings and errors only (ggml_log_level: 3 WARN, 4 ERROR, 5 a
    continuation of the previous line); llama-cpp-python's own callback maps these levels
    from an older enum and prints the whole INFO log."""
    global _printing
    _printing = level in (3, 4) or (level == 5 and _printing)
    if _printing:
        print(text.decode(errors="replace"), end="", file=sys.stderr, flush=True)


class LlamaCppSide:
    """compare_hf's worker side for llama.cpp (`model` is the GGUF's path)."""

    def __init__(self, model: str, max_batch: int, max_model_len: int):
        import llama_cpp as ll

        self.ll = ll
        self._log = ll.llama_log_callback(_warnings_only)  # kept: C holds the pointer
        ll.llama_log_set(self._log, None)
        ll.llama_backend_init()
        mparams = ll.llama_model_default_params()
        self.model = ll.llama_model_load_from_file(model.encode(), mparams)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {model}")
        self.n_vocab = ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(self.model))
        self.max_model_len = max_model_len
        self.contexts = {}  # batch size -> (llama_context, llama_batch), made at first use

    def _context(self, seqs: int):
        """The context for `seqs` sequences: n_seq_max = seqs, each its own f32 KV cache of
        max_model_len cells (not unified: a sequence attends over its own cells only)."""
        if seqs not in self.contexts:
            ll = self.ll
            cparams = ll.llama_context_default_params()
            cparams.n_seq_max = seqs
            cparams.n_ctx = seqs * self.max_model_len
            cparams.n_threads = cparams.n_threads_batch = os.cpu_count() or 1
            cparams.type_k = cparams.type_v = ll.GGML_TYPE_F32
            # Flash attention casts an f32 K/V to f16 (llama-graph.cpp, build_attn_mha):
            # measured 1.9e-3 max logit error against transformers (1.2e-6 without) and
            # 84% greedy agreement at batch 8 on the random Qwen3-MoE (100% without).
            cparams.flash_attn_type = ll.LLAMA_FLASH_ATTN_TYPE_DISABLED
            ctx = ll.llama_init_from_model(self.model, cparams)
            if not ctx:
                raise RuntimeError(f"llama.cpp could not create a context of {seqs} sequences")
            batch = ll.llama_batch_init(max(ll.llama_n_batch(ctx), seqs), 0, 1)
            self.contexts[seqs] = (ctx, batch)
        return self.contexts[seqs]

    def _decode(self, ctx, b, entries: list[tuple[int, int, int, bool]]) -> None:
        """One llama_decode of (token, position, sequence, wants logits) entries."""
        for i, (token, pos, seq, logits) in enumerate(entries):
            b.token[i], b.pos[i], b.n_seq_id[i] = token, pos, 1
            b.seq_id[i][0], b.logits[i] = seq, logits
        b.n_tokens = len(entries)
        if (rc := self.ll.llama_decode(ctx, b)) != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    def _argmax(self, ctx, rows: int) -> list[int]:
        """Argmax of the logits of the last call's `rows` outputs, in batch order."""
        import numpy as np

        logits = np.ctypeslib.as_array(self.ll.llama_get_logits(ctx), (rows, self.n_vocab))
        return logits.argmax(axis=1).tolist()

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        ll = self.ll
        ctx, b = self._context(len(prompts))
        ll.llama_memory_clear(ll.llama_get_memory(ctx), True)
        length = len(prompts[0])  # compare_hf's prompts have one length
        nxt = []
        for chunk in prefill_chunks(len(prompts), length, ll.llama_n_batch(ctx)):
            self._decode(ctx, b, [(t, p, s, p == length - 1)
                                  for s in chunk for p, t in enumerate(prompts[s])])  # fmt: skip
            nxt += self._argmax(ctx, len(chunk))
        out = [[t] for t in nxt]
        for step in range(1, max_tokens):
            self._decode(ctx, b, [(t, length + step - 1, s, True) for s, t in enumerate(nxt)])
            nxt = self._argmax(ctx, len(prompts))
            for row, t in zip(out, nxt, strict=True):
                row.append(t)
        return out

    @staticmethod
    def ceiling(n: int = 1024, reps: int = 10) -> float:
        """numpy's f32 matmul in this interpreter (compare_hf takes the best side's)."""
        import numpy as np

        a = np.ones((n, n), np.float32)
        a @ a
        best = float("inf")
        for _ in range(reps):
            start = time.perf_counter()
            a @ a
            best = min(best, time.perf_counter() - start)
        return 2 * n**3 / best


if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[1] != "--convert":
        sys.exit(f"usage: {sys.argv[0]} --convert CONVERTER MODEL_DIR [converter flags]")
    _convert_main(sys.argv[2], sys.argv[3:])
