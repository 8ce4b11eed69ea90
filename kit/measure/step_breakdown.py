"""Where a decode step's time goes (chapter 04): a few steps under torch.profiler, split into
the matrix products that stream the weights, greedy sampling, and everything else.

The bandwidth floor says what a step *could* take; this says what its parts *do* take. The
matrix products read every weight once per step, so their time alone gives the rate at which
the device's matrix library streams weights at this batch size: the ceiling for any strategy
built on that library (the README gives the rates seen).

The steps broken down are extra steps, run after the timed ones; torch.profiler slows a step
(each oneDNN call by about a third on the CPU here), so the parts are reported as shares of the
step under the profiler and as milliseconds scaled to the timed median, and so is the matmuls' rate.
"""
from __future__ import annotations

import re
import time
from dataclasses import dataclass

import torch

from kit.measure.device import synchronize
from kit.units import Bytes, BytesPerSecond, Count, Fraction, Seconds

# Event names of the products with the weights: ATen's and oneDNN's on the CPU (a linear is
# aten::mm or aten::addmm; Inductor calls the prepacked oneDNN linear as
# mkldnn::_linear_pointwise), while the eager attention's batched products (aten::bmm) count as
# everything else. On a GPU, cuBLAS / CUTLASS kernels by name, the eager attention's included.
GEMM = re.compile(r"linear|addmm|aten::mm\b|gemm|cutlass|xmma|nvjet", re.I)
SAMPLING = re.compile(r"argmax")
PARTS = ("weight matmuls", "sampling", "everything else")


@dataclass
class StepBreakdown:
    """One strategy's profiled steps: seconds per step in each part, and the weights' bytes."""

    strategy: str
    steps: int
    profiled_seconds: float       # wall time per profiled step
    gemm_seconds: float           # per step, self time of the products with the weights
    sampling_seconds: float       # per step
    gemm_weight_bytes: int        # what those products read per step
    device: str

    @property
    def other_seconds(self) -> float:
        return max(0.0, self.profiled_seconds - self.gemm_seconds - self.sampling_seconds)

    def shares(self) -> dict[str, float]:
        """Each part's fraction of the profiled step."""
        parts = (self.gemm_seconds, self.sampling_seconds, self.other_seconds)
        return {name: part / self.profiled_seconds for name, part in zip(PARTS, parts)}

    def scaled(self, step_seconds: float) -> dict[str, float]:
        """Each part in seconds of a step that takes `step_seconds` (the timed median)."""
        return {name: share * step_seconds for name, share in self.shares().items()}

    @property
    def gemm_bandwidth(self) -> float | None:
        """Bytes per second the weight matmuls stream the weights at (None if none seen:
        a CUDA graph replays its kernels out of the profiler's sight)."""
        return self.gemm_weight_bytes / self.gemm_seconds if self.gemm_seconds else None

    def gemm_bandwidth_at(self, step_seconds: float) -> float | None:
        """The same rate with the matmuls' share of the profiled step applied to an unprofiled
        step of `step_seconds` (the timed median): the profiler's own cost, which slowed each
        oneDNN call by about a third here, taken out with the rest of the step's."""
        share = self.shares()["weight matmuls"]
        return self.gemm_weight_bytes / (share * step_seconds) if self.gemm_seconds else None

    def summary(self) -> dict:
        return {"strategy": self.strategy, "steps": Count(self.steps), "device": self.device,
                **Seconds.of({"profiled_seconds": self.profiled_seconds,
                              "gemm_seconds": self.gemm_seconds,
                              "sampling_seconds": self.sampling_seconds,
                              "other_seconds": self.other_seconds}),
                "gemm_weight_bytes": Bytes.of(self.gemm_weight_bytes),
                "gemm_bandwidth": BytesPerSecond.of(self.gemm_bandwidth),
                "shares": Fraction.of(self.shares())}


def self_seconds(event, device: str) -> float:
    """An averaged event's self time: on the device for a GPU, on the CPU otherwise."""
    if device == "cuda":
        us = getattr(event, "self_device_time_total", None)
        if us is None:  # older torch
            us = getattr(event, "self_cuda_time_total", 0)
    else:
        us = event.self_cpu_time_total
    return us / 1e6


def split_events(events, device: str) -> tuple[float, float]:
    """Total self seconds of the weight matmuls and of sampling among `events`."""
    gemm = sampling = 0.0
    for e in events:
        if GEMM.search(e.key):
            gemm += self_seconds(e, device)
        elif SAMPLING.search(e.key):
            sampling += self_seconds(e, device)
    return gemm, sampling


@torch.no_grad()
def break_down_steps(step, steps: int, device: str, strategy: str,
                     gemm_weight_bytes: int) -> StepBreakdown:
    """`steps` calls of `step()` (one decode step each) under torch.profiler, split into parts;
    `gemm_weight_bytes`: what the weight matmuls of one step read."""
    from kit.measure.profiler import profiled
    synchronize(device)
    with profiled(device) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        synchronize(device)
        wall = time.perf_counter() - t0
    gemm, sampling = split_events(prof.key_averages(), device)
    return StepBreakdown(strategy, steps, wall / steps, gemm / steps, sampling / steps,
                         gemm_weight_bytes, device)
