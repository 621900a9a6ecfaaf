"""Test helpers for DeepSeek-V2/V3: tiny random HF configs (float32, std 0.2 weights so
routing and logits are far from ties) and a paged-cache allocator in the model's layout."""

from __future__ import annotations


def tiny_deepseek_v3_config(**overrides):
    """A small random-init HF DeepSeek-V3 config: q LoRA on, 8 experts in 4 groups (top-2
    groups), top-2, one shared expert, layer 0 dense, YaRN off."""
    from transformers import DeepseekV3Config

    base = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=32,
        kv_lora_rank=24,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=12,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=4,
        topk_group=2,
        n_shared_experts=1,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        max_position_embeddings=256,
        initializer_range=0.2,
        bos_token_id=None,
        eos_token_id=None,
    )
    base.update(overrides)
    return DeepseekV3Config(**base)


def tiny_deepseek_v2_config(**overrides):
    """A small random-init HF DeepSeek-V2 config: q LoRA off, softmax greedy gate, two
    shared experts, every layer MoE."""
    from transformers import DeepseekV2Config

    base = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=None,
        kv_lora_rank=24,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=2,
        first_k_dense_replace=0,
        routed_scaling_factor=1.0,
        topk_method="greedy",
        max_position_embeddings=256,
        initializer_range=0.2,
        bos_token_id=None,
        eos_token_id=None,
    )
    base.update(overrides)
    return DeepseekV2Config(**base)


YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 64,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 0.707,
    "mscale_all_dim": 1.0,
}


def new_cache(model, num_blocks: int, block_size: int):
    """A zero paged cache in the model's own layout (`model.kv_layout()`)."""
    return model.kv_layout().allocate(model.config.num_hidden_layers, num_blocks, block_size)


def write_deepseek_checkpoint(hf_config, path, seed: int = 0):
    """Like `model_utils.write_hf_checkpoint`, but V3's e_score_correction_bias (zeros at
    init) is drawn at random first, so a test sees whether the gate uses it. Returns the
    eval-mode torch model."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.normal_(0.0, 0.1)
    model.save_pretrained(path)
    return model


class DeepseekStepper:
    """`model_utils.ModelStepper` with the cache in the model's own layout."""

    def __init__(self, model):
        from tests.model_utils import ModelStepper

        self._inner = ModelStepper(model)
        self.layout = model.kv_layout()
        self.config = model.config
        self.paged = self._inner.paged
        self.cacheless = self._inner.cacheless

    def new_cache(self, num_blocks: int, block_size: int):
        return self.layout.allocate(self.config.num_hidden_layers, num_blocks, block_size)


def write_deepseek_folder(path, **overrides):
    """A random DeepSeek-V3 HF folder with the test tokenizer (config.json,
    model.safetensors, tokenizer.json), no EOS id. Returns the torch model, generation
    set to run to max_new_tokens."""
    from mock_engine import train_test_tokenizer

    tok = train_test_tokenizer()
    tok.save(str(path / "tokenizer.json"))
    config = tiny_deepseek_v3_config(
        vocab_size=tok.get_vocab_size(), **{"rope_parameters": YARN, **overrides}
    )
    model = write_deepseek_checkpoint(config, path, seed=0)
    model.generation_config.eos_token_id = None
    return model


def write_fp8_folders(src, fp8_dir, ref_dir, block, num_shards: int = 2, mtp_layers: int = 1):
    """From the HF folder `src`, write `fp8_dir` in DeepSeek's FP8 format and `ref_dir`
    with the same weights dequantized (float32), both with src's config.json.

    FP8 format (DeepSeek-V3 on the Hub): every 2-D linear weight except the embedding,
    the LM head and the gate is float8_e4m3fn, with a float32 `<name>_scale_inv` of one
    scale per `block` (amax / 448, partial blocks at the edges); config.json gets
    `quantization_config` and `num_nextn_predict_layers`, and `mtp_layers` random
    multi-token-prediction layers follow the decoder layers (model.layers.{L}...). The
    tensors are spread over `num_shards` files with a model.safetensors.index.json.
    Quantization and dequantization here are torch, independent of `models/fp8.py`.
    """
    import json
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    config = json.loads((src / "config.json").read_text())
    tensors = load_file(str(src / "model.safetensors"))
    br, bc = block
    fp8, ref = {}, {}
    for name, t in tensors.items():
        keep = any(s in name for s in ("embed_tokens", "lm_head", "mlp.gate.weight"))
        if t.ndim != 2 or keep:
            fp8[name] = ref[name] = t
            continue
        rows, cols = t.shape
        nr, nc = -(-rows // br), -(-cols // bc)
        padded = torch.zeros(nr * br, nc * bc)
        padded[:rows, :cols] = t
        blocks = padded.view(nr, br, nc, bc)
        scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0  # [nr, nc]
        full = scale.repeat_interleave(br, 0).repeat_interleave(bc, 1)[:rows, :cols]
        q = (t / full).to(torch.float8_e4m3fn)
        fp8[name], fp8[name + "_scale_inv"] = q, scale.float().contiguous()
        ref[name] = q.float() * full
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    for i in range(layers, layers + mtp_layers):
        fp8[f"model.layers.{i}.eh_proj.weight"] = torch.randn(hidden, 2 * hidden)
        fp8[f"model.layers.{i}.enorm.weight"] = torch.ones(hidden)
        fp8[f"model.layers.{i}.shared_head.norm.weight"] = torch.ones(hidden)
    for d in (fp8_dir, ref_dir):
        d.mkdir(parents=True, exist_ok=True)
        for extra in ("tokenizer.json", "generation_config.json"):
            if (src / extra).is_file():
                shutil.copy(src / extra, d / extra)
    names = sorted(fp8)
    weight_map = {}
    for s in range(num_shards):
        file = f"model-{s + 1:05d}-of-{num_shards:05d}.safetensors"
        part = {n: fp8[n].contiguous() for n in names[s::num_shards]}
        save_file(part, str(fp8_dir / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    (fp8_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    quant = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}
    fp8_config = {
        **config,
        "quantization_config": {**quant, "weight_block_size": list(block)},
        "num_nextn_predict_layers": mtp_layers,
    }
    (fp8_dir / "config.json").write_text(json.dumps(fp8_config))
    save_file({n: t.contiguous() for n, t in ref.items()}, str(ref_dir / "model.safetensors"))
    (ref_dir / "config.json").write_text(json.dumps(config))
    return tensors, ref
