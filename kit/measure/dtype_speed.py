"""A 16-bit dtype's matmul speed against float32's on this machine, and what it means for the
chapters (00 measures every dtype; 03, 04 and 05 say what their dtype costs here). Measured side
by side, bounded to about a second a dtype; on a CPU whose kernels emulate bf16 the gap is 70-90×.
"""
from __future__ import annotations

from dataclasses import dataclass

from kit.measure.device import cpu_isa
from kit.measure.throughput import Throughput, matmul_throughput
from kit.units import GBPerSecond, GFlopPerSecond, Ratio

# A 16-bit dtype whose matmuls run this many times slower than float32 is called slow here:
# natively they run at least as fast (twice as fast with AVX512-BF16, far more with AMX or on a
# GPU); PyTorch's fallback on a CPU without them converts to float32 inside every product.
SLOW_FACTOR = 2.0


@dataclass(frozen=True)
class DtypeSpeed:
    """A 16-bit dtype's matmul throughput against float32's, measured side by side."""

    dtype: str
    flops_per_second: float
    float32_flops_per_second: float

    @property
    def speed_vs_float32(self) -> float:
        """This dtype's FLOP/s ÷ float32's: 3.1 where it is 3.1× as fast, 0.01 where emulated."""
        return self.flops_per_second / self.float32_flops_per_second

    @property
    def slowdown(self) -> float:
        """float32's FLOP/s ÷ this dtype's: above SLOW_FACTOR, the dtype is slow here."""
        return self.float32_flops_per_second / self.flops_per_second

    @property
    def slow(self) -> bool:
        return self.slowdown > SLOW_FACTOR

    def summary(self) -> dict:
        return {"dtype": self.dtype, "gflops": GFlopPerSecond(self.flops_per_second / 1e9),
                "float32_gflops": GFlopPerSecond(self.float32_flops_per_second / 1e9),
                "speed_vs_float32": Ratio(self.speed_vs_float32), "slow": self.slow}


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


def hardware_figures(copy_rate: float | None, matmul_rates: dict[str, float]) -> dict:
    """What a chapter measured of the hardware, in the one shape every run's machine section
    gathers (`python -m kit run` reads this, never a chapter's own results): the copy in GB/s,
    matmuls in GFLOP/s per dtype, and each other dtype's `DtypeSpeed.speed_vs_float32` where float32's
    was measured too."""
    out = {} if copy_rate is None else {"copy_GB_per_s": GBPerSecond(copy_rate / 1e9)}
    out.update({f"matmul_GFLOP_per_s.{d}": GFlopPerSecond(rate / 1e9)
                for d, rate in matmul_rates.items()})
    if "float32" in matmul_rates:
        f32 = matmul_rates["float32"]
        out.update({f"speed_vs_float32.{d}": Ratio(DtypeSpeed(d, rate, f32).speed_vs_float32)
                    for d, rate in matmul_rates.items() if d != "float32"})
    return out


def beside_float32(device: str, dtype: str, rate: float) -> DtypeSpeed | None:
    """`rate`, the FLOP/s just measured in `dtype`, against float32's measured now (bounded;
    None in float32): says whether `dtype` is emulated here (chapter 04)."""
    if dtype == "float32":
        return None
    return DtypeSpeed(dtype, rate, matmul_throughput(device, "float32").rate)


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
    return beside_float32(device, dtype, matmul_throughput(device, dtype).rate)


def dtype_note_here(device: str, dtype: str, recorded: dict | None = None,
                    speed: DtypeSpeed | None = None) -> str:
    """`dtype_note` for this machine: `speed` if measured already, else chapter 00's record or
    a measurement now (`dtype_speed_here`)."""
    speed = speed or dtype_speed_here(device, dtype, recorded)
    return dtype_note(speed, cpu_isa() if device == "cpu" else None)
