"""Start-up checks `jaxserve serve` makes before it starts any process, so that the
common mistakes end with one line naming the cause and the fix (and exit code 2 or 1),
not a traceback from a child process a minute later.

What is checked here (`check_engine_settings` for what `jaxserve serve` and `jaxserve
engine` share): the model folder (config.json present, valid JSON, a supported
architecture with the fields it needs, weights and tokenizer present, a --max-model-len
within its max_position_embeddings) and the addresses (`--host` resolves to an address of
this machine, `check_host`; `--port`, `--metrics-port` and `--http-port` are distinct and
free) and --compilation-cache-dir (a writable folder). The TLS files are checked beside the
other frontend flags (`frontend.auth.TlsFiles.check`, from `cli._frontend_options`).
What needs the devices (a mesh that cannot hold the model, memory) is checked by the
engine, which reports its start-up error through `jaxserve.logs.report_start_failure`.
No JAX here (the frontend runs this).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import socket
from pathlib import Path
from typing import TYPE_CHECKING

from jaxserve.config import cache_root
from jaxserve.frontend.server_address import join_host_port

if TYPE_CHECKING:
    from jaxserve.config import EngineConfig

logger = logging.getLogger(__name__)

# Marker of a `jaxserve convert` (Orbax) folder: models/checkpoint.py MARKER_FILE, which
# imports JAX and so is not imported here.
_ORBAX_MARKER = "jaxserve_checkpoint.json"


def check_model_folder(
    model_dir: str | Path,
    *,
    check_model: bool = True,
    max_model_len: int | None = None,
    need_tokenizer: bool = True,
) -> None:
    """Raise ValueError ("model: ...") if `model_dir` cannot be served.

    check_model: also parse config.json as a model of a supported family and look for
    its weights; False for a stand-in engine (`--engine-class`, tests), which reads only
    the tokenizer and config.json's sizes.
    max_model_len: --max-model-len (None: unset); with check_model, a value above the
    model's max_position_embeddings raises ValueError("max-model-len: ...") naming the
    flag and the model's limit, as the engine would after loading (vLLM's check too).
    need_tokenizer: False for `jaxserve convert`, which converts the weights only.

    A broken config.json is named with the file, line and column of the JSON error. An
    EOS id outside the vocabulary is only warned about (`warn_eos_outside_vocab`).
    """
    folder = Path(model_dir)
    config_path = folder / "config.json"
    if not folder.is_dir():
        raise ValueError(f"model: {folder} is not a folder")
    if not config_path.is_file():
        raise ValueError(
            f"model: {folder} has no config.json (not a Hugging Face model folder; give the "
            "folder that holds config.json, *.safetensors and tokenizer.json)"
        )
    try:
        hf = json.loads(config_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(
            f"model: {config_path}: not valid JSON: {e.msg} at line {e.lineno} column {e.colno}"
        ) from None
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"model: cannot read {config_path} ({e})") from None
    if not isinstance(hf, dict):
        raise ValueError(f"model: {config_path}: expected a JSON object, got {type(hf).__name__}")
    if need_tokenizer and not (folder / "tokenizer.json").is_file():
        raise ValueError(f"model: no tokenizer.json in {folder} (the server tokenizes with it)")
    if not check_model:
        return
    from jaxserve.models.config import ModelConfig  # plain dicts, no JAX

    try:
        model_config = ModelConfig.from_hf(hf)
    except (ValueError, TypeError) as e:
        message = str(e).removeprefix("config.json: ")
        raise ValueError(f"model: {config_path}: {message}") from None
    warn_eos_outside_vocab(folder, model_config.eos_token_ids, model_config.vocab_size)
    limit = model_config.max_position_embeddings
    if max_model_len is not None and max_model_len > limit:
        raise ValueError(
            f"max-model-len: {max_model_len} tokens is above the model's limit of {limit} "
            f"(max_position_embeddings in {config_path}); pass --max-model-len {limit} "
            "or less"
        )
    if not (folder / _ORBAX_MARKER).is_file() and not any(folder.glob("*.safetensors")):
        raise ValueError(
            f"model: no *.safetensors weights in {folder} (only safetensors are read; "
            "convert *.bin checkpoints with transformers' save_pretrained)"
        )


def warn_eos_outside_vocab(folder: Path, eos_ids, vocab_size: int) -> list[int]:
    """Log one WARNING naming the EOS ids of config.json and generation_config.json that
    lie outside [0, vocab_size): the model can never sample them, so requests end only at
    max_tokens or a stop. A warning, not an error, as transformers and vLLM load such a
    model too. Returns those ids (sorted)."""
    ids = set(eos_ids)
    gen_path = folder / "generation_config.json"
    try:
        gen = json.loads(gen_path.read_text(encoding="utf-8")) if gen_path.is_file() else {}
        extra = gen.get("eos_token_id") if isinstance(gen, dict) else None
        ids.update([extra] if isinstance(extra, int) else extra or ())
    except (OSError, ValueError, TypeError):
        pass  # the loader names a broken generation_config.json
    bad = sorted(t for t in ids if isinstance(t, int) and not 0 <= t < vocab_size)
    if bad:
        logger.warning(
            "model: eos_token_id %s of %s is outside the vocabulary [0, %d) (vocab_size): "
            "the model never samples it, so requests end only at max_tokens or a stop",
            ", ".join(map(str, bad)), folder, vocab_size,
        )  # fmt: skip
    return bad


def check_compilation_cache_dir(path: str | None) -> None:
    """Raise ValueError("compilation-cache-dir: ...") if `path` cannot be the persistent
    compilation cache: not creatable (/proc/x), not a folder (a file) or not writable.
    When `path` is the default under $JAXSERVE_CACHE_ROOT, the message names that
    variable instead of the flag the user did not pass.
    Creates the folder, as the engine would (`engine.builder.enable_compilation_cache`).
    None: the cache is off (--no-compilation-cache)."""
    if not path:
        return
    name, fix = "compilation-cache-dir", "give --compilation-cache-dir a writable folder"
    root = os.environ.get("JAXSERVE_CACHE_ROOT")
    if root and path == str(cache_root() / "jax_cache"):
        # The default folder, under $JAXSERVE_CACHE_ROOT: the flag was not given.
        name, fix = (
            "JAXSERVE_CACHE_ROOT",
            f"point JAXSERVE_CACHE_ROOT (now {root}) at a writable folder",
        )
    fix += ", or pass --no-compilation-cache"
    folder = Path(path)
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"{name}: {path} is not a folder; {fix}")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"{name}: cannot create {path} ({e.strerror or e}); {fix}") from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ValueError(f"{name}: {path} is not writable; {fix}")


def check_engine_settings(config: EngineConfig, *, check_model: bool = True) -> None:
    """The engine's settings that need no device, checked before its process starts, by
    `jaxserve serve` and by `jaxserve engine` alike: the model folder with --max-model-len
    (`check_model_folder`; check_model as there) and --compilation-cache-dir
    (`check_compilation_cache_dir`). Raises ValueError naming the flag."""
    check_model_folder(
        config.model, check_model=check_model, max_model_len=config.scheduler.max_model_len
    )
    check_compilation_cache_dir(config.compilation_cache_dir)


def check_bind(flag: str, host: str, port: int) -> None:
    """Raise ValueError if `host`:`port` cannot be bound for listening (TCP).

    flag: the option named in the message: "host" when the address is the problem,
    else `flag` ("port", "metrics-port") when the port is busy. IPv6 literals ("::1")
    work as given or in brackets. SO_REUSEADDR as servers use it: a port in TIME_WAIT
    counts as free, one with a listener does not.
    """
    bare = host.strip("[]")
    try:
        infos = socket.getaddrinfo(bare, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ValueError(
            f"host: cannot resolve {host!r} ({e.strerror}); give an address of this machine "
            "(127.0.0.1, ::1, 0.0.0.0 or ::)"
        ) from None
    family, type_, proto, _, address = infos[0]
    try:
        with socket.socket(family, type_, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            probe.bind(address)
    except OSError as e:
        shown = join_host_port(host, port)
        if e.errno == errno.EADDRINUSE:
            raise ValueError(
                f"{flag}: cannot bind {shown} ({e}); another process listens there: "
                f"stop it or choose another --{flag}"
            ) from None
        raise ValueError(
            f"host: cannot bind {shown} ({e}); {host} is not an address of this machine "
            "(use 127.0.0.1, ::1, 0.0.0.0 or ::)"
        ) from None


def check_host(host: str) -> None:
    """Raise ValueError("host: ...") if `host` does not resolve or is not an address of
    this machine: a bad setting (exit code 2), told apart from a busy port (the system
    refusing, exit code 1, `check_ports`) by binding port 0 there first."""
    check_bind("host", host, 0)


def check_distinct_ports(
    port: int, metrics_port: int | None = None, http_port: int | None = None
) -> None:
    """Raise ValueError naming the flag if two of the gRPC `port`, `metrics_port` and
    `http_port` (None: not served) are the same port: a bad setting, found without
    binding anything. Port 0 (any free port) is never a clash."""
    ports = [("port", port), ("metrics-port", metrics_port), ("http-port", http_port)]
    seen: dict[int, str] = {}
    for flag, p in ports:
        if p is None:
            continue
        if p and p in seen:
            raise ValueError(
                f"{flag}: {p} is also --{seen[p]}; give each of --port, --metrics-port "
                "and --http-port its own port"
            )
        seen[p] = flag


def check_ports(
    host: str, port: int, metrics_port: int | None = None, http_port: int | None = None
) -> None:
    """Raise ValueError naming the flag if the gRPC `port`, `metrics_port` or `http_port`
    (None: not served) is taken by another of them (`check_distinct_ports`) or cannot be
    bound (`check_bind`)."""
    check_distinct_ports(port, metrics_port, http_port)
    ports = [("port", port), ("metrics-port", metrics_port), ("http-port", http_port)]
    for flag, p in ports:
        if p is not None:
            check_bind(flag, host, p)
