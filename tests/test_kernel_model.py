"""The one switch, end to end: a bf16 model's logits through the Pallas kernels (run by
the Mosaic GPU interpreter on the CPU, and compiled for the device where there is an
NVIDIA GPU) equal the pure-jnp reference path."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from conftest_gpu import skip_without_gpu  # noqa: F401 -- fixture used via pytestmark
from model_utils import (
    ModelStepper,
    StepRequest,
    build_step,
    tiny_qwen3_moe_config,
    write_hf_checkpoint,
)

from jaxserve.kernels import dispatch
from jaxserve.models.base import allocate_kv_cache
from jaxserve.models.loader import load_model

pytestmark = pytest.mark.usefixtures("skip_without_gpu")

BLOCK_SIZE = 8
MAX_BLOCKS = 4


def _logits(model, backend: str) -> np.ndarray:
    """Prefill two prompts (one crossing a block boundary), then decode one token each;
    returns the logits of both steps, [T1 + T2, vocab]."""
    with dispatch.backend_override(backend):
        stepper = ModelStepper(model)  # fresh jit: the backend is chosen at trace time
        c = model.config
        cache = allocate_kv_cache(
            c.num_hidden_layers, 16, BLOCK_SIZE, c.num_key_value_heads, c.head_dim, jnp.bfloat16
        )
        prompts = [list(range(3, 14)), list(range(40, 45))]
        tables = [[5, 2], [7]]
        step = build_step(
            [StepRequest(p, 0, t) for p, t in zip(prompts, tables, strict=True)],
            BLOCK_SIZE,
            MAX_BLOCKS,
        )
        prefill, cache = stepper.paged(*step[:2], cache, step[2])
        decode_reqs = [StepRequest([99], len(p), t) for p, t in zip(prompts, tables, strict=True)]
        step = build_step(decode_reqs, BLOCK_SIZE, MAX_BLOCKS)
        decode, _ = stepper.paged(*step[:2], cache, step[2])
    return np.concatenate([np.asarray(prefill), np.asarray(decode)]).astype(np.float32)


@pytest.mark.parametrize(
    "backend", [dispatch.INTERPRET, pytest.param(dispatch.PALLAS_MGPU, marks=pytest.mark.gpu)]
)
def test_model_logits_through_kernels_match_reference(tmp_path, caplog, backend):
    # Shapes the kernels take: head_dim 64, hidden and expert widths multiples of 128.
    # One (MoE) layer runs every kernel once per step; a second layer ran the same
    # kernels again at the same shapes, doubling the interpreter's time (about 25 s).
    config = tiny_qwen3_moe_config(
        hidden_size=128, intermediate_size=128, moe_intermediate_size=128, head_dim=64,
        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, initializer_range=0.05,
    )  # fmt: skip
    write_hf_checkpoint(config, tmp_path)
    model, _ = load_model(tmp_path, dtype=jnp.bfloat16)
    dispatch._fall_back.cache_clear()  # log every fallback of this test
    reference = _logits(model, dispatch.REFERENCE)
    kernels = _logits(model, backend)
    assert "cannot run" not in caplog.text, "a kernel fell back to the reference"
    assert np.isfinite(kernels).all()
    rel = np.abs(kernels - reference).max() / np.abs(reference).max()
    assert rel <= 2e-2, rel
    # The greedy choice agrees wherever the reference's top-2 are not a near tie.
    top2 = np.sort(reference, axis=-1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) > 0.05 * np.abs(reference).max()
    np.testing.assert_array_equal(kernels.argmax(-1)[clear], reference.argmax(-1)[clear])
