"""Chapter 00, the setup check: do the measurements work on this machine, and what to do when
one does not. Probes that fail record their error instead of stopping the notebook, and the
verdict names the fix for every failed check.
"""
from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass, field

import torch

from kit.engine.layers.expert_kernel import c_compiler
from kit.measure.device import CPU_KINDS, cpu_kind_of, synchronize
from kit.measure.memory import probe_measurement
from kit.measure.dtype_speed import hardware_figures
from kit.measure.throughput import MATMUL_DTYPES, Throughput, copy_bandwidth, matmul_throughput
from kit.units import Bytes, MiB, Seconds
from kit.vllm.cpu_kernels import VllmCpuKernels, vllm_cpu_kernels

PROBE_BYTES = 64 * MiB


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


@dataclass
class Compiler:
    """A compiler torch.compile runs on this machine, found the way the tool that runs it finds
    it; `command` None when there is none, `version` the first line of its `--version`."""

    language: str  # "C++" or "C"
    used_by: str
    command: str | None
    version: str | None
    install: str  # what to do when it is missing

    @property
    def found(self) -> bool:
        return self.command is not None and self.version is not None

    def line(self) -> str:
        if self.found:
            return f"{self.language} for {self.used_by}: {self.command} ({self.version})"
        return f"{self.language} for {self.used_by}: none found; {self.install}"


def version_line(command: str) -> str | None:
    """The first line `command --version` prints, or None when it cannot run."""
    try:
        done = subprocess.run([command, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = done.stdout.strip().splitlines()
    return lines[0] if done.returncode == 0 and lines else None


def inductor_cxx() -> Compiler:
    """The C++ compiler Inductor builds its CPU kernels with, as Inductor picks it
    (`torch._inductor.cpp_builder.get_cpp_compiler`: $CXX, else g++, the first that answers
    `--version`)."""
    from torch._inductor.cpp_builder import get_cpp_compiler
    command, _ = attempt(get_cpp_compiler)
    return Compiler("C++", "Inductor", command, command and version_line(command),
                    "apt-get install g++ (or conda install -c conda-forge gxx), or set CXX "
                    "to a C++ compiler")


def triton_cc() -> Compiler:
    """The C compiler Triton builds its launcher with at run time, in Triton's order
    (triton/runtime/build.py: $CC as given, else gcc, else clang on PATH)."""
    command = c_compiler()  # the same search the CPU's expert kernel makes
    return Compiler("C", "Triton", command, command and version_line(command),
                    "apt-get install gcc (or conda install -c conda-forge gcc), or set CC to a "
                    "C compiler")


def compilers(device: str) -> list[Compiler]:
    """The compilers torch.compile needs on `device`: Inductor's C++ compiler, and on CUDA
    also the C compiler Triton builds each kernel's launcher with."""
    return [inductor_cxx(), *([triton_cc()] if device == "cuda" else [])]


def attempt(fn, *args):
    """(fn(*args), None), or (None, "Error: message") when it raises: a probe that fails must
    still let the setup check reach its verdict."""
    try:
        return fn(*args), None
    except Exception as e:
        return None, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


@dataclass
class Probes:
    """What the probes measured; an `*_error` is set where a probe failed. The throughput
    probes (copy, a matmul per dtype) are bounded in time: about a second each."""

    probe_bytes: int
    seen_bytes: int | None
    seen_error: str | None
    compile_seconds: float | None
    compile_error: str | None
    copy: Throughput
    matmuls: dict[str, Throughput]

    def summary(self) -> dict:
        return {"probe_bytes": Bytes(self.probe_bytes),
                "probe_seen_bytes": Bytes.of(self.seen_bytes),
                "probe_compile_seconds": Seconds.of(self.compile_seconds),
                "copy": self.copy.summary(),
                "matmul": {k: m.summary() for k, m in self.matmuls.items()},
                "hardware": hardware_figures(self.copy.rate,
                                             {k: m.rate for k, m in self.matmuls.items()})}


def run_probes(device: str, progress=print) -> Probes:
    """An exact allocation seen by the memory measurement, a compile against eager, the copy
    bandwidth, and a matmul in each dtype."""
    seen, seen_error = attempt(probe_measurement, device, PROBE_BYTES)
    seconds, compile_error = attempt(probe_compile, device)
    copy = copy_bandwidth(device)
    progress(f"copy: {copy.rate / 1e9:,.1f} GB/s")
    matmuls = {}
    for dtype in MATMUL_DTYPES:
        matmuls[dtype] = matmul_throughput(device, dtype)
        progress(f"{dtype} matmul: {matmuls[dtype].rate / 1e9:,.1f} GFLOP/s")
    return Probes(PROBE_BYTES, seen, seen_error, seconds, compile_error, copy, matmuls)


@dataclass
class CpuPaths:
    """Which kind of CPU this is (a key of `kit.measure.device.CPU_KINDS`), whether oneDNN runs
    bf16 products with kernels of its own here (as it reports, any cap included), and the
    kernels vLLM's CPU build takes here per dtype (asked of vLLM; none off the CPU)."""

    kind: str
    onednn_bf16: bool
    onednn_capped: str | None
    vllm: list[VllmCpuKernels]

    def lines(self) -> list[str]:
        bf16 = ("native: oneDNN has bf16 kernels here" if self.onednn_bf16 else
                "emulated: oneDNN converts to float32 inside each product (many times slower)")
        cap = (f" (oneDNN capped at {self.onednn_capped}; vLLM's kernels below follow the "
               "CPU's own flags, which no cap reaches)") if self.onednn_capped else ""
        return [f"This CPU: {CPU_KINDS[self.kind]}.", f"bf16 matmuls: {bf16}{cap}.",
                *[k.library_line() for k in self.vllm[:1]]]

    def rows(self) -> list[dict]:
        """The kernels vLLM's CPU build takes here, a row per dtype."""
        return [k.row() for k in self.vllm if not k.error]

    def summary(self) -> dict:
        return {"kind": self.kind, "onednn_bf16": self.onednn_bf16,
                "vllm": {k.dtype: k.summary() for k in self.vllm}}


def cpu_paths(device: str, isa: dict, arch, block_size: int) -> CpuPaths:
    """This CPU's kind and the kernels its libraries take for `arch` at `block_size` in bf16
    and float32 (vLLM's only where the run is on the CPU)."""
    kernels = [vllm_cpu_kernels(dtype, block_size, arch.head_dim, arch.hidden_size,
                                arch.moe_intermediate_size or arch.intermediate_size)
               for dtype in ("bfloat16", "float32")] if device == "cpu" else []
    return CpuPaths(cpu_kind_of(isa), isa["onednn_bf16"], isa["onednn_max_isa"], kernels)


# What to do when a setup check fails, keyed by the start of the check's name.
FIXES = {
    "torch is": "Run ./setup.sh again (it pins torch 2.13.0 on the CPU); on a GPU machine create "
                "the conda environment from environment.yml.",
    "memory measurement": "Your torch build lacks the profiler's memory events: use the torch "
                          "that ./setup.sh or environment.yml installs.",
    "torch.compile": "Inductor needs a C++ compiler on the CPU (apt-get install g++, or conda "
                     "install gxx) and Triton on a GPU (it comes with CUDA builds of torch).",
    "compilers": "Install the compiler the check names as missing: a C++ compiler for Inductor "
                 "(apt-get install g++, or conda install -c conda-forge gxx) and, on a GPU, a C "
                 "compiler for Triton (apt-get install gcc); or point CXX / CC at ones you have.",
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
    """Chapter 00's verdict: ready or not, and for each failed check what to do
    (`kit.show.tables.Verdict` shows it)."""

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


def readiness(checks: list[dict], seconds: float) -> Readiness:
    """The verdict from the recorded checks (`rec.data["checks"]`): ready when all passed."""
    failed = [c["name"] for c in checks if not c["ok"]]
    todo = [(name, fix_for(name) or "See the notes above this cell.") for name in failed]
    return Readiness(ready=bool(checks) and not failed, passed=len(checks) - len(failed),
                     total=len(checks), seconds=seconds, todo=todo)
