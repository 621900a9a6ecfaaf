"""The model identity that a replica joining a frontend must share with it, and the one
line that names the first field where two differ.

A remote replica (`jaxserve engine`) runs its own copy of the model folder on another
host, so the frontend cannot assume it serves the same thing. What must match, so that
the frontend's tokenizer, validation and router are right for it:

- served_model_name: what clients name (GetServerInfo, the metrics, the HTTP API);
- architecture: config.json's `architectures[0]`;
- config_sha256: SHA-256 of config.json's content (its JSON, keys sorted: the same model
  whatever the file's formatting);
- tokenizer_sha256: SHA-256 of the tokenizer files (the frontend tokenizes, the
  replica's own sidecar detokenizes);
- dtype: the resolved serving dtype (`config.resolve_dtype`), so outputs agree;
- block_size: the router hashes prompts in blocks of this many tokens;
- max_model_len: as configured, else the model's max_position_embeddings (the engine
  may lower it to fit its KV cache: `ReplicaSet` compares the effective value too, once
  the replica is ready).

The weights are not hashed (tens of GB): two folders with the same config and tokenizer
but other weights pass. Cheap and JAX-free: both sides compute it before any engine
starts, so a mismatch costs no compilation.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from jaxserve.config import EngineConfig

# Files whose bytes make the tokenizer, in the order they are hashed (absent ones skipped).
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
    "merges.txt", "tokenizer.model",
)  # fmt: skip
FIELDS = (
    "served_model_name", "architecture", "config_sha256", "tokenizer_sha256", "dtype",
    "block_size", "max_model_len",
)  # fmt: skip


def model_identity(config: EngineConfig) -> dict:
    """The identity of what `config` serves (keys `FIELDS`; str and int values).

    A config.json that is missing or not JSON gives architecture "" and the hash of no
    content: the model's own checks report it when the engine starts.
    """
    folder = Path(config.model)
    try:
        hf = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        hf = {}
    hf = hf if isinstance(hf, dict) else {}
    archs = hf.get("architectures") or [""]
    tok = hashlib.sha256()
    for name in TOKENIZER_FILES:
        path = folder / name
        if path.is_file():
            tok.update(name.encode() + b"\0" + path.read_bytes())
    max_len = config.scheduler.max_model_len or hf.get("max_position_embeddings") or 0
    return {
        "served_model_name": config.served_model_name or folder.name,
        "architecture": str(archs[0]),
        "config_sha256": hashlib.sha256(json.dumps(hf, sort_keys=True).encode()).hexdigest(),
        "tokenizer_sha256": tok.hexdigest(),
        "dtype": config.dtype,
        "block_size": int(config.cache.block_size),
        "max_model_len": int(max_len),
    }


def first_difference(frontend: dict, replica: dict) -> str | None:
    """One line naming the first field of `FIELDS` where the two identities differ,
    with both values ("dtype: the frontend serves 'float32', the replica 'bfloat16'"),
    or None when they agree. A field missing on one side differs."""
    for key in FIELDS:
        mine, theirs = frontend.get(key), replica.get(key)
        if mine != theirs:
            return f"{key}: the frontend serves {mine!r}, the replica {theirs!r}"
    return None


def protocol_difference(frontend: int, replica) -> str | None:
    """The line for a protocol version mismatch, or None when they agree."""
    if replica == frontend:
        return None
    return f"protocol_version: the frontend speaks {frontend}, the replica {replica!r}"
