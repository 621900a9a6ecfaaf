"""`jaxserve serve --model <random DeepSeek-V3 folder>` streams over gRPC: greedy tokens
equal HF transformers' `generate` for token and text prompts, GetServerInfo
answers with the pool's block size, and the start-up log reports the latent KV layout
and its bytes per token."""

from __future__ import annotations

import pytest
from engine_helpers import hf_greedy
from server_harness import ServerProcess
from tokenizers import Tokenizer

from jaxserve.frontend.client import JaxserveClient
from tests.deepseek_utils import write_deepseek_folder

pytestmark = pytest.mark.slow

FLAGS = (
    "--max-num-seqs", "4", "--max-num-batched-tokens", "16", "--max-model-len", "64",
    "--num-blocks", "64", "--block-size", "8",
)  # fmt: skip
RPC_TIMEOUT_S = 120


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = tmp_path_factory.mktemp("ds_serve")
    hf = write_deepseek_folder(path, max_position_embeddings=64)
    srv = ServerProcess(path, extra_args=FLAGS, start_timeout_s=600).wait_ready()
    yield srv, hf, path
    srv.kill() if srv.proc.poll() is None else None


def test_serve_streams_deepseek_over_grpc(served):
    srv, hf, path = served
    prompt = [5, 77, 130, 9, 42, 250, 18]
    with JaxserveClient(srv.target) as client:
        deltas = list(
            client.generate(
                prompt, max_tokens=12, temperature=0.0, return_token_ids=True, timeout=RPC_TIMEOUT_S
            )
        )
        assert [t for d in deltas for t in d.token_ids] == hf_greedy(hf, prompt, 12)
        assert deltas[-1].finish_reason == "length"
        text = list(
            client.generate(
                "def main(",
                max_tokens=8,
                temperature=0.0,
                return_token_ids=True,
                timeout=RPC_TIMEOUT_S,
            )
        )
        # A text prompt goes through the served tokenizer. How many deltas carry the 8
        # tokens is timing: the frontend merges the outputs a busy stream has queued.
        ids = Tokenizer.from_file(str(path / "tokenizer.json")).encode("def main(").ids
        assert [t for d in text for t in d.token_ids] == hf_greedy(hf, ids, 8)
        assert text[-1].prompt_tokens == len(ids) and text[-1].finish_reason == "length"
        info = client.server_info(timeout=RPC_TIMEOUT_S)
    assert info.block_size == 8 and info.kv_blocks_total == 63
    # 3 layers * (kv_lora_rank 24 + qk_rope_head_dim 8) * 4 bytes (float32).
    assert info.kv_bytes_per_token == 384 and info.kv_layout == "MLA latent"
    assert "KV 384 bytes per token (MLA latent)" in srv.log()
