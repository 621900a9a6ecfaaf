"""Import one module's source as it was at a git ref: the baseline side of the A/B scripts
that time one module against its earlier self in one process (bench_pack_ab.py,
bench_parse_body.py)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import tempfile
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent


def load_module_at_ref(ref: str, path: str, name: str) -> ModuleType:
    """The module at `path` (relative to the repository root) as of git ref `ref`,
    imported under `name` and registered in sys.modules (dataclasses and pydantic look
    a class's module up there). Raises subprocess.CalledProcessError if git cannot show
    the file at that ref."""
    src = subprocess.run(
        ["git", "show", f"{ref}:{path}"], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout
    file = Path(tempfile.mkdtemp(prefix="module_at_ref_")) / f"{name}.py"
    file.write_text(src)
    spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    file.unlink()
    file.parent.rmdir()
    return module
