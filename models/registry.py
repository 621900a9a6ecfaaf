"""Model families by HF `architectures` name: the one place a new family is registered.

`config.SUPPORTED_ARCHITECTURES` lists the same names without importing JAX (the
frontend checks a model folder with it); tests/test_dense_models.py checks they agree.
"""

from __future__ import annotations

from jaxserve.models.config import SUPPORTED_ARCHITECTURES
from jaxserve.models.decoder import DecoderOnlyLM
from jaxserve.models.deepseek import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
from jaxserve.models.llama import LlamaForCausalLM
from jaxserve.models.mixtral import MixtralForCausalLM
from jaxserve.models.qwen2 import Qwen2ForCausalLM
from jaxserve.models.qwen3 import Qwen3ForCausalLM
from jaxserve.models.qwen3_moe import Qwen3MoeForCausalLM

MODEL_REGISTRY: dict[str, type[DecoderOnlyLM]] = {
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
    "DeepseekV2ForCausalLM": DeepseekV2ForCausalLM,
}


def supported_architectures() -> list[str]:
    """Names accepted in config.json `architectures`, sorted."""
    return sorted(MODEL_REGISTRY)


def model_class(architecture: str) -> type[DecoderOnlyLM]:
    """The model class for an HF architecture name.

    Raises:
        ValueError: unknown architecture; the message lists the supported ones.
    """
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        raise ValueError(
            f"config.json: architecture {architecture!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        ) from None
