"""Building the CPU kernels (XLA FFI custom calls in C++) on first use, and caching them.

Each kernel is one C++ source next to its Python module (it may include the headers
beside it, e.g. `cpu_work_sharing.h`), compiled for this CPU (-march=native) against
jaxlib's FFI headers with the C++ compiler on PATH ($CXX, else g++ or c++), into
`jaxserve.config.cache_root()/cpu_kernels`, keyed by the source, those headers, jax's
version, the compiler, the flags and the CPU. A kernel's module turns a failed
build into one warning and its XLA path (see `cpu_moe.py`, `cpu_attention.py`).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import jax

logger = logging.getLogger(__name__)

FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-w")


def switch_on(env_var: str) -> bool:
    """A kernel's on/off switch: whether `env_var` is unset or "1" ("0" turns the kernel
    off, for A/B benchmarks). Raises ValueError naming the variable for another value."""
    value = os.environ.get(env_var, "1").strip()
    if value not in ("0", "1"):
        raise ValueError(f"{env_var}={value!r}: expected 0 or 1")
    return value == "1"


def compiler() -> str | None:
    """The C++ compiler to build with: $CXX, else g++ or c++ on PATH; None if none."""
    for name in (os.environ.get("CXX"), "g++", "c++"):
        if name and shutil.which(name):
            return name
    return None


def build_library(source: Path, cxx: str | None) -> Path:
    """The shared library of `source` built with `cxx`, compiled into the cache unless
    already there.

    Raises RuntimeError without a compiler (`cxx` None) or if compiling fails (the
    message names the command and ends with the compiler's errors).
    """
    if cxx is None:
        raise RuntimeError("no C++ compiler on PATH (set CXX, or install g++)")
    from jaxserve.config import cache_root  # noqa: PLC0415 -- jaxserve.config imports models

    include = jax.ffi.include_dir()
    key = hashlib.sha256()
    for part in (source.read_bytes(), jax.__version__.encode(), cxx.encode(),
                 " ".join(FLAGS).encode(), _cpu_identity().encode()):  # fmt: skip
        key.update(part)
    for header in sorted(source.parent.glob("*.h")):  # what the source may include
        key.update(header.read_bytes())
    folder = cache_root() / "cpu_kernels"
    library = folder / f"{source.stem}-{key.hexdigest()[:16]}.so"
    if library.exists():
        return library
    folder.mkdir(parents=True, exist_ok=True)
    # Build to a temporary name, then rename: processes building at once never load a
    # half-written library.
    with tempfile.NamedTemporaryFile(dir=folder, suffix=".so", delete=False) as tmp:
        partial = Path(tmp.name)
    try:
        cmd = [cxx, *FLAGS, f"-I{include}", str(source), "-o", str(partial)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip()[-2000:]}")
        os.replace(partial, library)
    finally:
        partial.unlink(missing_ok=True)
    logger.info("built the CPU kernel %s: %s", source.name, library)
    return library


def register_kernel(build: Callable[[], Path], target: str, symbol: str, what: str) -> bool:
    """Build a kernel (`build()`, usually `build_library`) and register its FFI handler
    `symbol` as XLA's CPU custom-call target `target`.

    Returns False, after one warning "`what` unavailable, ...: CAUSE", if it cannot be
    built (no compiler, a failed compile); True once registered.
    """
    try:
        library = build()
    except (OSError, subprocess.SubprocessError, RuntimeError) as err:
        logger.warning("%s unavailable: %s", what, err)
        return False
    lib = ctypes.cdll.LoadLibrary(str(library))
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
    return True


def cpu_flags() -> set[str]:
    """The feature flags of this CPU (the `flags` line of /proc/cpuinfo; empty where it
    cannot be read, e.g. off Linux)."""
    for line in _cpu_identity().splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return set()


def _cpu_identity() -> str:
    """The CPU a -march=native build is for: the machine, model name and feature flags."""
    lines = []
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("model name", "flags")):
                    lines.append(line.strip())
                if len(lines) == 2:
                    break
    except OSError:
        pass
    return platform.machine() + "\n" + "\n".join(lines)
