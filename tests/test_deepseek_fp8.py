"""FP8 block-quantized DeepSeek-V3 checkpoints (DeepSeek's format, written by the test in
torch): they load dequantized to exactly the weights of the dequantized reference
folder, give HF transformers' logits of that reference, and their multi-token-prediction
layers are skipped with a log line."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from flax import nnx

from jaxserve.models.loader import load_model
from tests.deepseek_utils import (
    tiny_deepseek_v3_config,
    write_deepseek_checkpoint,
    write_fp8_folders,
)
from tests.model_utils import hf_logits

PROMPT = [17, 200, 3, 45, 99, 120, 7, 64, 33]


@pytest.fixture(scope="module")
def src_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("ds_src")
    write_deepseek_checkpoint(tiny_deepseek_v3_config(), path, seed=3)
    return path


def _params(model) -> dict:
    return {k: np.asarray(v.get_value()) for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


# DeepSeek's 128x128 (every tiny matrix is one partial block) and a small block that
# cuts every matrix into several, partial ones at the edges included.
@pytest.mark.parametrize("block", [(128, 128), (16, 24)])
def test_fp8_checkpoint_loads_as_its_dequantized_reference(src_dir, tmp_path, block, caplog):
    import torch
    from transformers import AutoModelForCausalLM

    fp8_dir, ref_dir = tmp_path / "fp8", tmp_path / "ref"
    original, ref = write_fp8_folders(src_dir, fp8_dir, ref_dir, block, num_shards=3)
    # The quantization is real: the dequantized weights are not the float32 originals.
    name = "model.layers.1.self_attn.kv_b_proj.weight"
    assert (ref[name] - original[name]).abs().max() > 0

    with caplog.at_level(logging.INFO, logger="jaxserve.models.loader"):
        model, config = load_model(fp8_dir)
    assert config.fp8_weight_block == block and config.num_mtp_layers == 1
    assert any(
        "multi-token-prediction" in r.getMessage() and "[3]" in r.getMessage()
        for r in caplog.records
    )
    ref_model, _ = load_model(ref_dir)
    got, want = _params(model), _params(ref_model)
    assert got.keys() == want.keys()
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=str(key))

    if block == (128, 128):
        hf = AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32).eval()
        import jax.numpy as jnp

        hidden, _ = model(jnp.asarray(PROMPT), jnp.arange(len(PROMPT)), None, None)
        np.testing.assert_allclose(
            np.asarray(model.compute_logits(hidden)), hf_logits(hf, PROMPT), atol=1e-4, rtol=0
        )


def test_unsupported_quantization_names_the_field(src_dir, tmp_path):
    import json
    import shutil

    bad = tmp_path / "awq"
    shutil.copytree(src_dir, bad)
    config = json.loads((bad / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq"}
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="quantization_config.quant_method"):
        load_model(bad)
