#!/usr/bin/env bash
# Set up .venv with everything the kit needs. Safe to run again: it reinstalls only when
# pyproject.toml or this script changed.
set -euo pipefail
cd "$(dirname "$0")"
PYTHON=${PYTHON:-python3}
if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
    echo "setup.sh: the kit needs Python 3.11 or newer ($PYTHON is $("$PYTHON" --version))." >&2
    echo "          Run it as PYTHON=python3.11 ./setup.sh" >&2
    exit 1
fi
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
stamp=.venv/.kit-setup
want=$(cat pyproject.toml setup.sh | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    echo "setup.sh: installing into .venv (a few minutes the first time) ..."
    pip=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)
    # The CPU build of torch 2.13.0, the one vLLM's CPU package requires.
    "${pip[@]}" "torch==2.13.0"
    "${pip[@]}" -e ".[test]"
    echo "$want" > "$stamp"
fi
.venv/bin/python -c 'import torch, papermill, plotly; print(f"setup.sh: ready (torch {torch.__version__})")'
