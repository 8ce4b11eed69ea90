"""Where a decode step's time goes (chapter 04): a few steps under torch.profiler, split into
the matrix products that stream the weights, greedy sampling, and everything else.

The bandwidth floor says what a step *could* take; this says what its parts *do* take. The
matrix products read every weight once per step, so their time alone gives the rate at which
the device's matrix library streams weights at this batch size: the ceiling for any strategy
built on that library (docs/measurements.md, "Where the time goes", gives the rates seen).

The steps broken down are extra steps, run after the timed ones. The profile's table
(`kit.measure.profile_rows`) is split by name:

- On the CPU, the host ops' self CPU time: the products with the weights are ATen's and
  oneDNN's ops (GEMM), the argmax is sampling (SAMPLING), the eager attention's batched
  products (aten::bmm) are everything else. torch.profiler slows a step (each oneDNN call by
  about a third here), so the parts are shares of the step under the profiler, scaled to the
  timed median, and so is the matmuls' rate.
- On a GPU, the device's rows only (`split_kernels`): host ops carry their kernels' time too,
  so counting both would count it twice, and a CUDA graph's replay has no host op at all. Each
  kernel is sorted by its name (`kernel_part`), so eager, compiled and CUDA-graph steps that run
  the same kernels split the same. Kernel names do not tell a batched product from a weight
  product; the batched products' kernels are taken out of the matmuls by their launching op's
  row (aten::bmm's self device time is exactly its kernels'), as on the CPU. A graph replaying
  a bmm would leave it among the matmuls, but the graphs here replay the compiled step, whose
  attention sums products instead. Kernel times are read on the device's clock, which the
  profiler does not slow (its cost is on the host, in the gaps between kernels), so the parts
  keep their measured milliseconds in the timed median and the rest of it is everything else.
"""
from __future__ import annotations

import re
import time
from dataclasses import dataclass, field

import torch

from kit.measure.device import synchronize
from kit.measure.profile_rows import ProfileRow, rows_from_profile
from kit.units import Bytes, BytesPerSecond, Count, Fraction, Seconds

# The CPU's host ops: a linear is aten::mm or aten::addmm; Inductor calls the prepacked oneDNN
# linear as mkldnn::_linear_pointwise; the kit's kernel (kit::expert_products) multiplies the
# experts and, in a compiled decode step of few rows, large dense weights; aten::bmm (the eager
# attention) is everything else.
GEMM = re.compile(r"linear|addmm|aten::mm\b|gemm|expert_products|cutlass|xmma|nvjet", re.I)
SAMPLING = re.compile(r"argmax")
PARTS = ("weight matmuls", "sampling", "everything else")

# A GPU's kernels. cuBLAS(Lt): nvjet_tst_64x8_64x16_4x1_v_bz_splitK_TNT (Hopper, CUDA 12.9+),
# sm90_xmma_gemm_..._cublas, ampere_bf16_s16816gemm_..., gemv2T_kernel_val / internal::gemvx /
# gemvNSP_kernel (a decode batch of one), cublasLt::splitKreduce_kernel (a split-K's second
# pass); CUTLASS: cutlass::Kernel2<cutlass_80_..._s16816gemm_...>, cutlass3x_sm90_..._gemm_...
# Never "cutlass" alone: FlashAttention's and the memory-efficient attention's kernels carry
# cutlass:: types in their names, which ATTENTION_KERNEL sorts out first.
GEMM_KERNEL = re.compile(r"nvjet|gemm|gemv|splitKreduce|cublas")
ATTENTION_KERNEL = re.compile(r"flash|fmha|attention|sdpa", re.I)
SAMPLING_KERNEL = re.compile(r"argmax", re.I)  # ATen's reduce_kernel<...ArgMaxOps<float>...>
# Inductor's Triton kernels: triton_{poi,red,per,tem}_fused_<the ATen ops fused>_<n>. A
# template (tem) or a reduction holding mm/addmm is a product; a pointwise kernel named after
# addmm is only its bias; bmm (a batched product) and names like
# "..._rocm_unquantized_gemm_rsqrt_0" (a norm beside a custom op) are not weight products.
TRITON_KERNEL = re.compile(r"triton_(poi|red|per|tem)_")
TRITON_PRODUCTS = {"mm", "addmm"}
# Host ops whose kernels are batched products (the eager attention's), not weight products.
BATCHED_PRODUCTS = ("aten::bmm", "aten::baddbmm")


def kernel_part(name: str) -> str:
    """Which part of a step a device row (kernel, memcpy, memset) belongs to, by its name."""
    triton = TRITON_KERNEL.match(name)
    if triton:
        tokens = set(name.split("_"))
        if triton.group(1) != "poi" and tokens & TRITON_PRODUCTS:
            return PARTS[0]
        return PARTS[1] if "argmax" in tokens else PARTS[2]
    if ATTENTION_KERNEL.search(name):
        return PARTS[2]
    if SAMPLING_KERNEL.search(name):
        return PARTS[1]
    return PARTS[0] if GEMM_KERNEL.search(name) else PARTS[2]


def split_host_ops(rows: list[ProfileRow]) -> tuple[float, float]:
    """The CPU's split: self CPU seconds of the host ops named as weight products (GEMM) and as
    sampling (SAMPLING), summed in the table's order."""
    gemm = sampling = 0.0
    for r in rows:
        if GEMM.search(r.name):
            gemm += r.self_cpu_us / 1e6
        elif SAMPLING.search(r.name):
            sampling += r.self_cpu_us / 1e6
    return gemm, sampling


def split_kernels(rows: list[ProfileRow]) -> tuple[float, float]:
    """A GPU's split: self device seconds of the weight products' kernels and of sampling's,
    each kernel counted once (device rows only, `kernel_part`), less the batched products'
    kernels (their launching ops' self device time: none in a graph replay)."""
    parts = dict.fromkeys(PARTS, 0.0)
    for r in rows:
        if r.on_device:
            parts[kernel_part(r.name)] += r.self_device_us
    batched = sum(r.self_device_us for r in rows
                  if r.device_type == "CPU" and r.name in BATCHED_PRODUCTS)
    return max(0.0, parts[PARTS[0]] - batched) / 1e6, parts[PARTS[1]] / 1e6


def split_rows(rows: list[ProfileRow], device: str) -> tuple[float, float]:
    """Total self seconds of the weight matmuls and of sampling among a profile's `rows`."""
    return split_kernels(rows) if device == "cuda" else split_host_ops(rows)


@dataclass
class StepBreakdown:
    """One strategy's profiled steps: seconds per step in each part, the weights' bytes, and
    the profile's table (`rows`, kept for a run that records it: `save_profile_tables`)."""

    strategy: str
    steps: int
    profiled_seconds: float       # wall time per profiled step (synchronized on a GPU)
    gemm_seconds: float           # per step, self time of the products with the weights
    sampling_seconds: float       # per step
    gemm_weight_bytes: int        # what those products read per step
    device: str
    rows: list[ProfileRow] = field(default_factory=list, repr=False, compare=False)

    @property
    def other_seconds(self) -> float:
        return max(0.0, self.profiled_seconds - self.gemm_seconds - self.sampling_seconds)

    @property
    def device_clock(self) -> bool:
        """Whether the parts were timed on the device's clock (a GPU's kernels), which the
        profiler does not slow, rather than on the host's, which it does."""
        return self.device == "cuda"

    def shares(self) -> dict[str, float]:
        """Each part's fraction of the profiled step."""
        parts = (self.gemm_seconds, self.sampling_seconds, self.other_seconds)
        return {name: part / self.profiled_seconds for name, part in zip(PARTS, parts)}

    def scaled(self, step_seconds: float) -> dict[str, float]:
        """Each part in seconds of a step that takes `step_seconds` (the timed median): the
        shares of the profiled step applied to it on the CPU; on a GPU the kernels' own
        seconds, and the rest of the step (other kernels, and the gaps where the device waits
        for the host) as everything else."""
        if not self.device_clock:
            return {name: share * step_seconds for name, share in self.shares().items()}
        measured = (self.gemm_seconds, self.sampling_seconds)
        return dict(zip(PARTS, (*measured, max(0.0, step_seconds - sum(measured)))))

    @property
    def gemm_bandwidth(self) -> float | None:
        """Bytes per second the weight matmuls stream the weights at (None if no product with
        the weights was seen)."""
        return self.gemm_weight_bytes / self.gemm_seconds if self.gemm_seconds else None

    def gemm_bandwidth_at(self, step_seconds: float) -> float | None:
        """The same rate in an unprofiled step of `step_seconds` (the timed median). On the
        CPU the matmuls' share of the profiled step is applied to it: the profiler's own cost,
        which slowed each oneDNN call by about a third here, taken out with the rest of the
        step's. On a GPU the kernels' times are already unslowed: the rate as measured."""
        if not self.gemm_seconds or self.device_clock:
            return self.gemm_bandwidth
        share = self.shares()["weight matmuls"]
        return self.gemm_weight_bytes / (share * step_seconds)

    def summary(self) -> dict:
        return {"strategy": self.strategy, "steps": Count(self.steps), "device": self.device,
                **Seconds.of({"profiled_seconds": self.profiled_seconds,
                              "gemm_seconds": self.gemm_seconds,
                              "sampling_seconds": self.sampling_seconds,
                              "other_seconds": self.other_seconds}),
                "gemm_weight_bytes": Bytes.of(self.gemm_weight_bytes),
                "gemm_bandwidth": BytesPerSecond.of(self.gemm_bandwidth),
                "shares": Fraction.of(self.shares())}


@torch.no_grad()
def break_down_steps(step, steps: int, device: str, strategy: str,
                     gemm_weight_bytes: int) -> StepBreakdown:
    """`steps` calls of `step()` (one decode step each) under torch.profiler, split into parts
    (`split_rows`); `gemm_weight_bytes`: what the weight matmuls of one step read. The
    profile's table stays on the result (`rows`)."""
    from kit.measure.profiler import profiled
    synchronize(device)
    with profiled(device) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        synchronize(device)
        wall = time.perf_counter() - t0
    rows = rows_from_profile(prof)
    gemm, sampling = split_rows(rows, device)
    return StepBreakdown(strategy, steps, wall / steps, gemm / steps, sampling / steps,
                         gemm_weight_bytes, device, rows)
