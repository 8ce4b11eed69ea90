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
# The browser tests (tests/test_browser.py) drive Debian's Chromium; they never download one.
# Installed here when missing and apt-get can run without a password; quick when present.
if [ -z "${KIT_CHROMIUM:-}" ] && ! command -v chromium >/dev/null && ! command -v chromium-browser >/dev/null; then
    sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo -n"
    if command -v apt-get >/dev/null && { [ -z "$sudo" ] || sudo -n true 2>/dev/null; }; then
        echo "setup.sh: installing Debian's chromium for the browser tests ..."
        if ! log=$( { $sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $sudo apt-get \
                install -y -qq --no-install-recommends chromium fonts-dejavu-core; } 2>&1 ); then
            echo "$log" | tail -n 5 >&2
            echo "setup.sh: could not install chromium; the browser tests will fail until it is" >&2
        fi
    else
        echo "setup.sh: no Chromium found: the notebooks work without it, but the browser tests need" \
             "it (apt-get install chromium, or set KIT_CHROMIUM=/path/to/chromium)." >&2
    fi
fi
.venv/bin/python -c 'import torch, papermill, plotly; print(f"setup.sh: ready (torch {torch.__version__})")'
