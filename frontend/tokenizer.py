"""Loading a model folder's tokenizer (`tokenizer.json`, the Hugging Face `tokenizers` format).

The frontend tokenizes prompts and the sidecar detokenizes outputs with the same object;
the offline `LLM` API should load it here too, so that text prompts become the same ids.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer


def load_tokenizer(model_dir: str | Path) -> Tokenizer:
    """The tokenizer of a Hugging Face model folder.

    Raises FileNotFoundError naming the missing tokenizer.json, ValueError if it is not a
    valid `tokenizers` file.
    """
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"model: no tokenizer.json in {Path(model_dir)}")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # the Rust side raises a bare Exception
        raise ValueError(f"model: cannot load {path}: {e}") from e


def encode_prompt(tokenizer: Tokenizer, text: str) -> list[int]:
    """Token ids of a text prompt, with the tokenizer's own special tokens (its
    post-processor decides, e.g. a BOS token), as Hugging Face `tokenizer(text)` does."""
    return tokenizer.encode(text, add_special_tokens=True).ids
