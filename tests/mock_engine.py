"""A mock engine and a tiny tokenizer, so the frontend, sidecar and processes are tested on
the CPU in milliseconds without JAX (the idea of JetStream's mock engine).

`MockEngineCore` has the interface of `jaxserve.engine.core.EngineCore`; its tokens are a
fixed function of the prompt, the seed and the position (`mock_tokens`), so a test knows
every request's output in advance. It keeps KV-block accounting like a paged cache:
a request holds ceil((prompt + max_tokens) / block_size) blocks while admitted.

The engine process loads it with `--engine-class mock_engine:MockEngineCore` (the tests
folder on PYTHONPATH). `JAXSERVE_MOCK_STEP_DELAY_S` makes each step sleep, so that
streams last long enough to be aborted mid-way; `JAXSERVE_MOCK_START_DELAY_S` delays
start-up; `JAXSERVE_MOCK_WARMUP_S` reports `MOCK_WARMUP_SHAPES` step shapes compiling in
the background for that many seconds after start-up (as `engine.warmup` does).
"""

from __future__ import annotations

import json
import math
import os
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from jaxserve.config import EngineConfig
from jaxserve.ipc import EngineRequest, EngineStats, TokenOutput

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MOCK_VOCAB_SIZE = 512
MOCK_MAX_MODEL_LEN = 4096
MOCK_WARMUP_SHAPES = 4  # "compiling in the background" while JAXSERVE_MOCK_WARMUP_S lasts

# Multi-byte UTF-8 (CJK, emoji, accents) so that single tokens split characters.
_CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "import os\nimport sys\nprint(os.getcwd())\n",
    "The quick brown fox jumps over the lazy dog. 🦊🐶",
    "你好，世界！这是一个测试。机器学习和深度学习。",
    "こんにちは世界。テストです。",
    "Ünïcödé façade naïve café résumé 😀😃😄🎉👍",
    "for i in range(10):\n    print(i ** 2)  # squares\n",
    "emoji 🤖 robots 🚀 rockets 🌍 world ❤️ love",
]


def train_test_tokenizer(vocab_size: int = MOCK_VOCAB_SIZE) -> Tokenizer:
    """A byte-level BPE tokenizer trained on a small in-memory corpus (deterministic)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 8, trainer)
    return tok


def write_mock_model_dir(path: Path) -> Path:
    """Write a model folder the frontend and the mock engine can load: tokenizer.json and a
    config.json with the vocabulary size and the model length."""
    path.mkdir(parents=True, exist_ok=True)
    tok = train_test_tokenizer()
    tok.save(str(path / "tokenizer.json"))
    config = {
        "architectures": ["MockForCausalLM"],
        "vocab_size": tok.get_vocab_size(),
        "max_position_embeddings": MOCK_MAX_MODEL_LEN,
        "eos_token_id": 0,
        "first_text_token_id": len(SPECIAL_TOKENS),
    }
    (path / "config.json").write_text(json.dumps(config))
    return path


def mock_tokens(prompt_token_ids, seed: int | None, n: int, vocab_size: int, first_id: int):
    """The first n tokens the mock emits for a prompt: a hash of (prompt, seed, position)
    mapped into [first_id, vocab_size), so no special token is ever produced."""
    base = _mock_base(prompt_token_ids, seed)
    return [_mock_token(base, i, vocab_size, first_id) for i in range(n)]


def mock_logprobs(token: int, k: int, vocab_size: int) -> list:
    """The mock's log-probs entry for a token (the ipc.TokenOutput.logprobs format):
    [logprob, [[top_id, logprob], ...k]] with made-up but deterministic values."""
    logprob = -((token % 7) + 1) / 10
    top = [[(token + j) % vocab_size, logprob - j] for j in range(k)]
    return [logprob, top]


def _mock_base(prompt_token_ids, seed: int | None) -> int:
    prompt = np.asarray(prompt_token_ids, dtype=np.int64)
    base = int((prompt * 1_000_003 + np.arange(len(prompt)) * 7919).sum() % (2**31))
    return base ^ ((seed or 0) * 2654435761 % (2**31))


def _mock_token(base: int, i: int, vocab_size: int, first_id: int) -> int:
    x = (base + (i + 1) * 0x9E3779B1) % (2**32)  # splitmix-style mixing
    x = ((x ^ (x >> 16)) * 0x45D9F3B) % (2**32)
    x = ((x ^ (x >> 16)) * 0x45D9F3B) % (2**32)
    x ^= x >> 16
    return first_id + x % (vocab_size - first_id)


@dataclass(slots=True)
class _MockRequest:
    request_id: str
    prompt: list[int]
    sampling: dict
    output: list[int] = field(default_factory=list)
    blocks: int = 0
    sent_first: bool = False


class MockEngineCore:
    """EngineCore's interface over deterministic fake tokens; see the module docstring."""

    def __init__(self, config: EngineConfig) -> None:
        meta = json.loads((Path(config.model) / "config.json").read_text())
        self.model = config.model
        self.vocab_size = int(meta["vocab_size"])
        self.first_id = int(meta.get("first_text_token_id", 0))
        self.eos_token_id = meta.get("eos_token_id")
        self.max_model_len = config.scheduler.max_model_len or int(meta["max_position_embeddings"])
        self.block_size = config.cache.block_size
        self.num_blocks = config.cache.num_blocks or 256
        self.max_num_seqs = config.scheduler.max_num_seqs
        self.step_delay_s = float(os.environ.get("JAXSERVE_MOCK_STEP_DELAY_S", "0"))
        # Stands in for loading weights and compiling: the server is not ready meanwhile.
        time.sleep(float(os.environ.get("JAXSERVE_MOCK_START_DELAY_S", "0")))
        warmup_s = float(os.environ.get("JAXSERVE_MOCK_WARMUP_S", "0"))
        self._warm_at = time.monotonic() + warmup_s
        self._free_blocks = self.num_blocks
        self._waiting: deque[_MockRequest] = deque()
        self._running: dict[str, _MockRequest] = {}
        self._pending: list[TokenOutput] = []  # errors and aborts for the next step

    def add_request(self, req: EngineRequest) -> None:
        prompt = [int(t) for t in np.asarray(req.prompt_token_ids)]
        max_tokens = int(req.sampling.get("max_tokens", 16))
        if not prompt or len(prompt) + max_tokens > self.max_model_len:
            self._pending.append(
                TokenOutput(req.request_id, [], finish_reason="error", error="prompt: too long")
            )
            return
        self._waiting.append(_MockRequest(req.request_id, prompt, dict(req.sampling)))

    def abort_requests(self, request_ids) -> None:
        ids = set(request_ids)
        for r in [r for r in self._waiting if r.request_id in ids]:
            self._waiting.remove(r)
            self._pending.append(self._final(r, "abort"))
        for rid in ids & self._running.keys():
            self._pending.append(self._final(self._running.pop(rid), "abort"))

    def has_work(self) -> bool:
        return bool(self._waiting or self._running or self._pending)

    def step(self) -> list[TokenOutput]:
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        outputs, self._pending = self._pending, []
        self._admit()
        for r in list(self._running.values()):
            outputs.append(self._decode_one(r))
        return outputs

    def request_counts(self) -> tuple[int, int]:
        return len(self._running), len(self._waiting)

    def stats(self) -> EngineStats:
        stats = EngineStats(
            model=self.model,
            max_model_len=self.max_model_len,
            block_size=self.block_size,
            num_blocks_total=self.num_blocks,
            num_blocks_free=self._free_blocks,
            vocab_size=self.vocab_size,
            num_running=len(self._running),
            num_waiting=len(self._waiting),
        )
        if time.monotonic() < self._warm_at:
            stats.counters.warmup_pending_shapes = MOCK_WARMUP_SHAPES
        return stats

    def _admit(self) -> None:
        while self._waiting and len(self._running) < self.max_num_seqs:
            r = self._waiting[0]
            need = math.ceil((len(r.prompt) + r.sampling.get("max_tokens", 16)) / self.block_size)
            if need > self._free_blocks:
                return
            self._waiting.popleft()
            r.blocks, self._free_blocks = need, self._free_blocks - need
            self._running[r.request_id] = r

    def _decode_one(self, r: _MockRequest) -> TokenOutput:
        s = r.sampling
        base = _mock_base(r.prompt, s.get("seed"))
        token = _mock_token(base, len(r.output), self.vocab_size, self.first_id)
        r.output.append(token)
        finish, stop_reason = None, None
        if token in s.get("stop_token_ids", ()):
            finish, stop_reason = "stop", token
        elif token == self.eos_token_id and not s.get("ignore_eos", False):
            finish = "stop"
        elif (
            len(r.output) >= s.get("max_tokens", 16)
            or len(r.prompt) + len(r.output) >= self.max_model_len
        ):
            finish = "length"
        if finish is not None:
            self._running.pop(r.request_id)
            out = self._final(r, finish, [token], stop_reason)
        else:
            out = self._output(r, [token])
        if s.get("logprobs") is not None:
            out.logprobs = [mock_logprobs(token, s["logprobs"], self.vocab_size)]
        return out

    def _output(self, r: _MockRequest, new: list[int]) -> TokenOutput:
        out = TokenOutput(
            r.request_id, new, num_prompt_tokens=len(r.prompt), num_output_tokens=len(r.output)
        )
        if not r.sent_first:
            out.first = {"prompt_token_ids": r.prompt, "sampling": r.sampling}
            r.sent_first = True
        return out

    def _final(self, r, finish: str, new: list[int] | None = None, stop_reason=None) -> TokenOutput:
        self._free_blocks += r.blocks
        r.blocks = 0
        out = self._output(r, new or [])
        out.finish_reason, out.stop_reason = finish, stop_reason
        return out
