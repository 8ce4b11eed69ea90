"""Throughput probes bounded in time (chapters 00 and 04, and every run's machine section):
copy bandwidth and matmul FLOP/s per dtype.

A probe of fixed size takes whatever time the hardware needs: six 2048² bfloat16 products are
a second on a CPU with native bf16 and six minutes on one that emulates it. So each probe here
sizes itself to a time budget instead: it starts small, grows the size while one call stays
well under the budget (up to a size past the caches), then repeats the call at that size until
the budget is spent (at least `MIN_REPEATS` times). A slow dtype shows as a slow number, never
as minutes of waiting.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from kit.measure.device import torch_dtype
from kit.measure.timing import Timings, time_fn
from kit.units import (Bytes, BytesPerSecond, Count, FlopPerSecond, GiB, MiB,
                       Seconds)

BUDGET_SECONDS = 1.0
MIN_REPEATS = 3
MAX_REPEATS = 50
# The largest sizes: a copy well past any CPU's last-level cache (and a GPU's L2); a product
# big enough to reach a device's compute roof.
COPY_LIMIT = {"cpu": 256 * MiB, "cuda": 2 * GiB}
MATMUL_LIMIT = {"cpu": 2048, "cuda": 8192}
MATMUL_DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class Throughput:
    """One probe: `work` units (bytes moved, or FLOPs) per call at `size`, timed repeatedly."""

    what: str           # "copy", or "matmul"
    device: str
    dtype: str
    size: int           # bytes copied, or n of the n×n product
    work: float         # bytes read + written, or FLOPs, per call
    timings: Timings
    sizing_seconds: float  # spent finding the size, before the timed calls

    @property
    def rate(self) -> float:
        """Bytes per second (copy) or FLOP/s (matmul), at the median call."""
        return self.work / self.timings.median

    @property
    def seconds(self) -> float:
        """The probe's whole time: sizing and timed calls."""
        return self.sizing_seconds + sum(self.timings.seconds)

    def summary(self) -> dict:
        copy = self.what == "copy"
        return {"what": self.what, "device": self.device, "dtype": self.dtype,
                "size": (Bytes if copy else Count)(self.size),
                "rate": (BytesPerSecond if copy else FlopPerSecond)(self.rate),
                "median_s": Seconds(self.timings.median), "spread_s": Seconds(self.timings.spread),
                "repeats": Count(len(self.timings.seconds)), "probe_seconds": Seconds(self.seconds)}


def fit_size(make_call, start: int, limit: int, exponent: int, device: str, target: float,
             align: int):
    """The largest size up to `limit` whose call takes about `target` seconds or less, grown from
    `start` (work ∝ size**exponent); returns (size, its call, the last call's seconds)."""
    size = start
    while True:
        fn = make_call(size)
        # one timed call after one that pays for allocation and kernel selection
        seconds = time_fn(fn, device, repeats=1, warmup=1).median
        if size >= limit or seconds >= target / 2:
            return size, fn, seconds
        grow = min(4.0, (target / max(seconds, 1e-7)) ** (1 / exponent))
        size = min(limit, max(size + align, int(size * grow) // align * align))


def bounded(what: str, device: str, dtype: str, make_call, work_of, start: int, limit: int,
            exponent: int, align: int, budget: float) -> Throughput:
    """Size the call to about a tenth of `budget`, then repeat it for the rest of the budget."""
    t0 = time.perf_counter()
    size, fn, seconds = fit_size(make_call, start, limit, exponent, device, budget / 10, align)
    sizing = time.perf_counter() - t0
    left = max(0.0, budget - sizing)
    repeats = max(MIN_REPEATS, min(MAX_REPEATS, int(left / max(seconds, 1e-7))))
    timings = time_fn(fn, device, repeats=repeats, warmup=0)
    return Throughput(what, device, dtype, size, work_of(size), timings, sizing)


def copy_bandwidth(device: str, budget: float = BUDGET_SECONDS) -> Throughput:
    """Bytes read + written per second by a device-to-device copy (a large memcpy on the CPU)."""
    limit = COPY_LIMIT.get(device, COPY_LIMIT["cpu"])

    def make_call(nbytes):
        src = torch.ones(nbytes, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        return lambda: dst.copy_(src)
    return bounded("copy", device, "uint8", make_call, lambda n: 2 * n, min(limit, 16 * MiB),
                   limit, 1, MiB, budget)


def matmul_throughput(device: str, dtype: str, budget: float = BUDGET_SECONDS) -> Throughput:
    """FLOP/s of a square matmul in `dtype`: the compute roof a step could at best reach."""
    limit = MATMUL_LIMIT.get(device, MATMUL_LIMIT["cpu"])

    def make_call(n):
        a = torch.randn(n, n, device=device).to(torch_dtype(dtype))
        b = torch.randn(n, n, device=device).to(torch_dtype(dtype))
        return lambda: a @ b
    return bounded("matmul", device, dtype, make_call, lambda n: 2 * n**3, 128, limit, 3, 64,
                   budget)
