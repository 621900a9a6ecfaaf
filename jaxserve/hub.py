"""Model sources: a local folder, or a Hugging Face model id resolved through the HF cache.

`jaxserve serve Qwen/Qwen3-0.6B` (and `LLM(model="Qwen/Qwen3-0.6B")`) work as in vLLM: a
`model` that is not an existing folder but has the shape of a Hub id (`org/name`,
optionally `@revision`) is fetched with `huggingface_hub.snapshot_download` into the
standard cache, or found there offline. The cache and the network are the usual
environment variables', read at each call (not at import, so a test or a caller can set
them late): `HF_HUB_CACHE`, else `HF_HOME`/hub, else ~/.cache/huggingface/hub; with
`HF_HUB_OFFLINE=1` only the cache is read. Only the files the engine reads are
downloaded (config, tokenizer, safetensors and their index). No JAX here: the frontend
resolves the model before it starts the engine.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

# What the engine and the tokenizer read from a model folder (no *.bin, no *.pth, no
# original/ consolidated checkpoints: they would double the download).
ALLOW_PATTERNS = (
    "*.json",
    "*.safetensors",
    "tokenizer.model",
    "*.tiktoken",
    "*.txt",
)

# A Hub repo id: "name" or "org/name" of [A-Za-z0-9._-], 96 characters at most each
# (huggingface_hub.utils.validate_repo_id's rule), optionally "@revision".
_REPO_ID = re.compile(r"^(?:[\w.-]{1,96}/)?[\w.-]{1,96}(?:@[\w./-]+)?$")
_TRUE = {"1", "on", "yes", "true"}


def hub_cache_dir() -> Path:
    """The HF hub cache folder the environment names (see the module docstring)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "huggingface"
    )
    return Path(home).expanduser() / "hub"


def hub_offline() -> bool:
    """Whether HF_HUB_OFFLINE (or the older TRANSFORMERS_OFFLINE) forbids the network."""
    return any(
        os.environ.get(name, "").strip().lower() in _TRUE
        for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    )


def looks_like_repo_id(model: str) -> bool:
    """Whether `model` has the shape of a Hub id ("org/name", "name", "org/name@rev").

    A string starting with ".", "/" or "~" is always a path."""
    return not model.startswith((".", "/", "~")) and bool(_REPO_ID.match(model))


def resolve_model(model: str) -> str:
    """The local folder to serve for `model`: the folder itself when it exists, else the
    cached (or downloaded) snapshot of the Hub id `model`.

    Returns a path (str). Raises ValueError starting with "model:" when `model` is
    neither a folder nor a Hub id, or when the id cannot be resolved (not in the cache
    while offline, no such repository, gated, network down); the message says which and
    what to do.
    """
    path = Path(model).expanduser()
    if path.is_dir():
        return str(path)
    if path.exists():
        raise ValueError(f"model: {model} is a file; give the model's folder (with config.json)")
    if not looks_like_repo_id(model):
        raise ValueError(
            f"model: {model!r} is neither a folder nor a Hugging Face model id (org/name)"
        )
    repo_id, _, revision = model.partition("@")
    return _snapshot(repo_id, revision or None)


def _snapshot(repo_id: str, revision: str | None) -> str:
    # Imported here: the frontend serving a local folder never pays for it.
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    cache = hub_cache_dir()
    offline = hub_offline()
    try:
        return snapshot_download(
            repo_id,
            revision=revision,
            cache_dir=str(cache),
            local_files_only=offline,
            allow_patterns=list(ALLOW_PATTERNS),
        )
    except LocalEntryNotFoundError:
        why = (
            "HF_HUB_OFFLINE is set"
            if offline
            else "the Hugging Face Hub cannot be reached (no network?)"
        )
        raise ValueError(
            f"model: {repo_id!r} is not a local folder and not in the Hugging Face cache "
            f"{cache}, and {why}; download it where the network allows "
            f"(`hf download {repo_id}`) or give a model folder"
        ) from None
    except GatedRepoError:
        raise ValueError(
            f"model: {repo_id!r} is a gated repository; accept its terms on huggingface.co "
            "and log in (`hf auth login`, or set HF_TOKEN)"
        ) from None
    except RepositoryNotFoundError:
        raise ValueError(
            f"model: no Hugging Face repository {repo_id!r} (and no folder of that name); "
            "check the id, or log in if it is private"
        ) from None
    except RevisionNotFoundError:
        raise ValueError(f"model: {repo_id!r} has no revision {revision!r}") from None
    except (HfHubHTTPError, OSError) as e:
        raise ValueError(f"model: cannot download {repo_id!r}: {e}") from None
