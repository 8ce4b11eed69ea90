"""Chapter 00, the setup check: do the measurements work on this machine, and what to do when
one does not. Probes that fail record their error instead of stopping the notebook, and the
verdict names the fix for every failed check.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from kit.measure.device import cpu_isa, synchronize
from kit.measure.memory import probe_measurement
from kit.measure.throughput import (MATMUL_DTYPES, MIN_REPEATS, Throughput, copy_bandwidth,
                                     matmul_throughput)

PROBE_BYTES = 64 * 2**20
# A 16-bit dtype whose matmuls run this many times slower than float32 is called slow here:
# natively they run at least as fast (twice as fast with AVX512-BF16, far more with AMX or on a
# GPU); PyTorch's fallback on a CPU without them converts to float32 inside every product.
SLOW_FACTOR = 2.0


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
        return {"probe_bytes": self.probe_bytes, "probe_seen_bytes": self.seen_bytes,
                "probe_compile_seconds": self.compile_seconds,
                "copy": self.copy.summary(),
                "matmul": {k: m.summary() for k, m in self.matmuls.items()}}


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


@dataclass(frozen=True)
class DtypeSpeed:
    """A 16-bit dtype's matmul throughput against float32's, measured side by side."""

    dtype: str
    flops_per_second: float
    float32_flops_per_second: float

    @property
    def slowdown(self) -> float:
        """float32's FLOP/s ÷ this dtype's: above SLOW_FACTOR, the dtype is slow here."""
        return self.float32_flops_per_second / self.flops_per_second

    @property
    def slow(self) -> bool:
        return self.slowdown > SLOW_FACTOR

    def summary(self) -> dict:
        return {"dtype": self.dtype, "gflops": self.flops_per_second / 1e9,
                "float32_gflops": self.float32_flops_per_second / 1e9,
                "slowdown_vs_float32": self.slowdown, "slow": self.slow}


def dtype_speeds(matmuls: dict[str, Throughput]) -> dict[str, DtypeSpeed]:
    """Each 16-bit dtype's matmul FLOP/s against float32's."""
    f32 = matmuls["float32"].rate
    return {k: DtypeSpeed(k, m.rate, f32) for k, m in matmuls.items() if k != "float32"}


def native_flag(dtype: str, isa: dict) -> str:
    """The CPU flag that would make `dtype`'s matmuls native, and whether the CPU has it."""
    name = {"bfloat16": "avx512_bf16", "float16": "amx_fp16"}[dtype]
    if "arm_bf16" in isa and dtype == "bfloat16":
        name = "arm_bf16"
    return f"{name}: {'yes' if isa.get(name) else 'no'}"


def speed_finding(speed: DtypeSpeed, isa: dict | None) -> str:
    """One sentence on a dtype's measured matmul speed, with the ISA beside it (CPU)."""
    rate = f"{speed.flops_per_second / 1e9:,.1f} GFLOP/s"
    if not speed.slow:
        return (f"{speed.dtype} matmuls run at {rate}, {1 / speed.slowdown:.1f}× float32's: "
                "native here.")
    where = "" if isa is None else (
        f" (PyTorch's kernels: {isa['pytorch_kernels']}; {native_flag(speed.dtype, isa)}"
        f"{'; oneDNN capped at ' + isa['onednn_max_isa'] if isa.get('onednn_max_isa') else ''})")
    return (f"{speed.dtype} matmuls run at {rate}, {speed.slowdown:,.0f}× slower than float32: "
            f"emulated on this machine{where}, each product converted to float32 and back.")


def slow_dtype_consequence(dtype: str, speed: DtypeSpeed) -> str:
    """What a slow `dtype` means for chapters 03–05, and the way out."""
    return (f"Chapters 03–05 run in {dtype} by default, because vLLM serves a model in its own "
            f"dtype; here its matmuls are {speed.slowdown:,.0f}× slower than float32's, so "
            "profiling forwards (large matmuls) take many times longer and decode steps up to a "
            f"few times longer than on a CPU with native {dtype}, the kit's and vLLM's alike. "
            "dtype=\"float32\" is the way out: fast matmuls here, at twice the bytes for the "
            "weights, the activations and every KV block (half the blocks from the same budget).")


def dtype_note(speed: DtypeSpeed | None, isa: dict | None) -> str:
    """What chapters 03–05 print about their dtype's matmuls on this machine."""
    if speed is None:
        return ("float32: no 16-bit conversion in any matmul, at twice the bytes of a 16-bit dtype "
                "for the weights, the activations and every KV block.")
    note = speed_finding(speed, isa)
    return f"{note} {slow_dtype_consequence(speed.dtype, speed)}" if speed.slow else note


def dtype_speed_here(device: str, dtype: str, recorded: dict | None) -> DtypeSpeed | None:
    """`dtype`'s matmul speed against float32's: chapter 00's measurement when this run folder
    holds one for the same device (`recorded`), else measured now (a second per dtype)."""
    if dtype == "float32":
        return None
    recorded = recorded or {}
    same_device = recorded.get("settings", {}).get("device") == device
    matmul = recorded.get("results", {}).get("matmul") if same_device else None
    if matmul and dtype in matmul:
        return DtypeSpeed(dtype, matmul[dtype]["rate"], matmul["float32"]["rate"])
    rates = {k: matmul_throughput(device, k).rate for k in ("float32", dtype)}
    return DtypeSpeed(dtype, rates[dtype], rates["float32"])


def dtype_note_here(device: str, dtype: str, recorded: dict | None = None,
                    speed: DtypeSpeed | None = None) -> str:
    """`dtype_note` for this machine: `speed` if measured already, else chapter 00's record or
    a measurement now (`dtype_speed_here`)."""
    speed = speed or dtype_speed_here(device, dtype, recorded)
    return dtype_note(speed, cpu_isa() if device == "cpu" else None)


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
    """Chapter 00's verdict: ready or not, and for each failed check what to do
    (`kit.show.tables.verdict` shows it)."""

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
