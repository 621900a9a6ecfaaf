"""Model families (Flax NNX), HF config parsing and safetensors loading.

Entry points: `loader.load_model(dir, dtype) -> (model, ModelConfig)`, the model's
`__call__(tokens, positions, kv_cache, metadata)` / `compute_logits(hidden)` (contract in
`base.py`), `base.allocate_kv_cache`, and `loader.save_hf_weights(model, dir)`.
Families are registered in `registry.py`.
"""
