#!/usr/bin/env bash
# Create (or reuse) the virtual environment at $JAXSERVE_VENV (default .venv) with a
# Python >= 3.12 and install jaxserve into it with the extras given as arguments.
#   bash scripts/setup_venv.sh            # runtime only
#   bash scripts/setup_venv.sh test       # + pytest, torch (CPU use), transformers
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${JAXSERVE_VENV:-.venv}"

find_python() {
  # jax 0.11 needs Python >= 3.12; machines whose default python3 is older have it under pyenv.
  # 3.12 first: the version the project's GPU machines run.
  for cand in python3.12 python3.13 python3; do
    if command -v "$cand" >/dev/null 2>&1 &&
       "$cand" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
      echo "$cand"; return 0
    fi
  done
  if command -v pyenv >/dev/null 2>&1; then
    for v in $(pyenv versions --bare | grep -E '^3\.(1[2-9])' | sort -V); do
      p="$(pyenv root)/versions/$v/bin/python3"
      [ -x "$p" ] && { echo "$p"; return 0; }
    done
  fi
  return 1
}

if [ ! -x "$venv/bin/python" ]; then
  py="$(find_python)" || { echo "error: no Python >= 3.12 found (install one, e.g. with pyenv)" >&2; exit 1; }
  echo "creating $venv with $("$py" --version)" >&2
  "$py" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip
fi

extras=""
[ $# -gt 0 ] && extras="[$(IFS=,; echo "$*")]"
# A strict editable install: build/__editable__.*/ mirrors the package tree in links and
# is one static path entry, which IDEs and type checkers follow (no import hook). Code
# changes need no reinstall; a new or removed file does (the link tree lists files), so
# reinstall when pyproject.toml, the extras or the package files changed. Run from the
# repository root (tests, `python -m jaxserve...`), the tree itself is imported anyway.
stamp="$venv/.jaxserve-install"
files="$(find jaxserve/ models/ sharding/ eplb/ frontend/ -type f -not -path '*/__pycache__/*' | sort | sha256sum | cut -c1-64)"
want="$(sha256sum pyproject.toml | cut -c1-64) $files $extras"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  "$venv/bin/python" -m pip install -q -e ".$extras" --config-settings editable_mode=strict
  echo "$want" > "$stamp"
fi
