"""HF config parsing, safetensors loading (single, sharded, fused experts), load errors,
placement hook, and export back to HF names (checked by loading it with transformers)."""

from __future__ import annotations

import json
import logging
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from jaxserve.models.config import ModelConfig
from jaxserve.models.loader import load_model, save_hf_weights
from tests.model_utils import hf_logits, tiny_qwen3_moe_config, write_hf_checkpoint

PROMPT = [5, 77, 130, 2, 250, 31]
ATOL = 1e-4


def _logits(model, tokens):
    hidden, _ = model(jnp.asarray(tokens, jnp.int32), jnp.arange(len(tokens)), None, None)
    return np.asarray(model.compute_logits(hidden))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(folder, HF model) of a tiny 2-layer Qwen3-MoE (layer 0 dense, layer 1 MoE)."""
    path = tmp_path_factory.mktemp("qwen3_tiny")
    hf_model = write_hf_checkpoint(
        tiny_qwen3_moe_config(num_hidden_layers=2, mlp_only_layers=[0]), path, seed=1
    )
    return path, hf_model


def _copy_with_tensors(src, dst, edit):
    """Copy a single-file checkpoint to `dst`, passing its tensor dict through `edit`."""
    shutil.copytree(src, dst)
    with safe_open(str(src / "model.safetensors"), framework="np") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    save_file(edit(tensors), str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


# ----- config.json ----------------------------------------------------------------------


def test_config_parses_hf_fields(checkpoint):
    path, hf_model = checkpoint
    config = ModelConfig.from_hf(json.loads((path / "config.json").read_text()))
    hf = hf_model.config
    assert config.architecture == "Qwen3MoeForCausalLM"
    assert config.num_experts == hf.num_experts and config.head_dim == hf.head_dim
    assert config.rope_theta == hf.rope_parameters["rope_theta"]
    # is_moe_layer must agree with the block HF actually built for each layer.
    for i, layer in enumerate(hf_model.model.layers):
        assert config.is_moe_layer(i) == (type(layer.mlp).__name__ == "Qwen3MoeSparseMoeBlock")


def test_config_legacy_and_list_fields():
    config = ModelConfig.from_hf(
        {
            "architectures": ["MixtralForCausalLM"],
            "vocab_size": 32,
            "hidden_size": 16,
            "intermediate_size": 8,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "max_position_embeddings": 64,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "rope_theta": 500.0,
            "eos_token_id": [2, 7],
            "sliding_window": 8,
        }
    )
    assert config.eos_token_ids == (2, 7)
    assert config.rope_theta == 500.0
    assert config.num_key_value_heads == 2 and config.head_dim == 8
    assert config.norm_topk_prob  # Mixtral always renormalizes
    assert config.moe_intermediate_size == 8 and config.sliding_window == 8


def test_config_rejects_rope_scaling(checkpoint):
    path, _ = checkpoint
    hf = json.loads((path / "config.json").read_text())
    hf["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}
    with pytest.raises(ValueError, match="rope_parameters.rope_type='yarn'"):
        ModelConfig.from_hf(hf)


def test_generation_config_eos_ids_are_added(checkpoint, tmp_path):
    path, _ = checkpoint
    dst = shutil.copytree(path, tmp_path / "ckpt")
    (dst / "generation_config.json").write_text(json.dumps({"eos_token_id": [9, 11]}))
    _, config = load_model(dst)
    assert config.eos_token_ids == (9, 11)


# ----- loading ----------------------------------------------------------------------------


def test_sharded_checkpoint_with_index_loads(checkpoint, tmp_path):
    _, hf_model = checkpoint
    hf_model.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    model, _ = load_model(tmp_path)
    np.testing.assert_allclose(_logits(model, PROMPT), hf_logits(hf_model, PROMPT), atol=ATOL)


def test_fused_expert_layout_loads(checkpoint, tmp_path):
    # transformers 5.x keeps experts fused in memory (gate_up_proj [E, 2I, H]); a
    # checkpoint written from its state_dict has that layout.
    _, hf_model = checkpoint
    shutil.copy(checkpoint[0] / "config.json", tmp_path / "config.json")
    tensors = {k: v.numpy() for k, v in hf_model.state_dict().items()}
    assert "model.layers.1.mlp.experts.gate_up_proj" in tensors
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    model, _ = load_model(tmp_path)
    np.testing.assert_allclose(_logits(model, PROMPT), hf_logits(hf_model, PROMPT), atol=ATOL)


def test_unsupported_architecture_lists_supported(checkpoint, tmp_path):
    dst = shutil.copytree(checkpoint[0], tmp_path / "ckpt")
    hf = json.loads((dst / "config.json").read_text())
    # (LlamaForCausalLM, this test's first example, is supported since issue 14.)
    hf["architectures"] = ["GPTNeoXForCausalLM"]
    (dst / "config.json").write_text(json.dumps(hf))
    with pytest.raises(
        ValueError, match="'GPTNeoXForCausalLM'.*MixtralForCausalLM.*Qwen3MoeForCausalLM"
    ):
        load_model(dst)


def test_missing_tensor_is_named(checkpoint, tmp_path):
    name = "model.layers.1.mlp.experts.3.up_proj.weight"
    dst = _copy_with_tensors(
        checkpoint[0], tmp_path / "ckpt", lambda t: {k: v for k, v in t.items() if k != name}
    )
    with pytest.raises(ValueError, match=f"missing tensor '{name}'"):
        load_model(dst)


def test_truncated_weights_file_is_named(checkpoint, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(checkpoint[0], dst)
    weights = dst / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(ValueError, match=f"{weights}: not a readable safetensors file"):
        load_model(dst)


def test_misshaped_tensor_is_named_with_shapes(checkpoint, tmp_path):
    name = "model.layers.0.self_attn.k_proj.weight"

    def edit(tensors):
        tensors[name] = tensors[name][:16]
        return tensors

    dst = _copy_with_tensors(checkpoint[0], tmp_path / "ckpt", edit)
    with pytest.raises(ValueError, match=rf"'{name}' has shape \(16, 64\), expected \(32, 64\)"):
        load_model(dst)


def test_unused_tensors(checkpoint, tmp_path, caplog):
    extra = "model.layers.0.mlp.shared_expert.weight"
    dst = _copy_with_tensors(
        checkpoint[0], tmp_path / "weights", lambda t: {**t, extra: np.zeros(4, np.float32)}
    )
    with pytest.raises(ValueError, match=extra):
        load_model(dst)

    buffer = "model.layers.0.self_attn.rotary_emb.inv_freq"
    dst = _copy_with_tensors(
        checkpoint[0], tmp_path / "buffer", lambda t: {**t, buffer: np.zeros(8, np.float32)}
    )
    with caplog.at_level(logging.WARNING):
        load_model(dst)
    assert buffer in caplog.text


def test_dtype_and_sharding_hook(checkpoint):
    path, _ = checkpoint
    calls = {}
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])

    def shardings(param_path, axes):
        calls[param_path] = axes
        return device

    model, _ = load_model(path, dtype="bfloat16", shardings=shardings)
    assert calls["layers.1.mlp.w_gate"] == ("experts", "embed", "expert_mlp")
    assert calls["layers.0.self_attn.q_proj"] == ("embed", "q_heads", "head_dim")
    assert calls["embed_tokens"] == ("vocab", "embed")
    w_gate = model.layers[1].mlp.w_gate[...]
    assert w_gate.dtype == jnp.bfloat16 and w_gate.sharding == device


# ----- export -----------------------------------------------------------------------------


def test_save_hf_weights_round_trips_through_transformers(checkpoint, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    path, hf_model = checkpoint
    model, _ = load_model(path)
    save_hf_weights(model, tmp_path)
    shutil.copy(path / "config.json", tmp_path / "config.json")
    with safe_open(str(tmp_path / "model.safetensors"), framework="np") as f:
        assert "model.layers.1.mlp.experts.0.gate_proj.weight" in f.keys()

    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    for (name, ours), (_, theirs) in zip(
        reloaded.state_dict().items(), hf_model.state_dict().items(), strict=True
    ):
        np.testing.assert_array_equal(ours.numpy(), theirs.numpy(), err_msg=name)
