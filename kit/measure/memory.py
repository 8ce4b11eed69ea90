"""Memory measurement (chapters 00, 01, 02): what a call allocates, at its peak and after it.

On CUDA the caching allocator's statistics give the peak, and `cudaMemGetInfo` the memory used
outside PyTorch's allocator. On the CPU there is no allocator counter, so live bytes are
integrated from `torch.profiler`'s memory events, which also see the buffers Inductor-compiled
code allocates (a dispatch-level tracker would miss those). Both devices can record a timeline
of live bytes, each change named by the operation that made it.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch

from kit.measure.device import synchronize
from kit.measure.profiler import profiled
from kit.units import MiB


@dataclass
class Allocations:
    """What one call allocated, in bytes above what was allocated before it."""

    result: object = field(repr=False)
    peak_bytes: int
    left_bytes: int                # still allocated when the call returned
    seconds: float                 # the call's wall time (under the profiler when it ran)
    timeline_ms: list[float] = field(repr=False, default_factory=list)
    timeline_bytes: list[int] = field(repr=False, default_factory=list)
    timeline_ops: list[str] = field(repr=False, default_factory=list)


def measure_allocations(fn, device: str, timeline: bool = True) -> Allocations:
    """Run `fn()` once and measure its allocations: the allocator's statistics on CUDA (with
    the profiler's timeline when `timeline`), the profiler's memory events on the CPU."""
    cuda = device == "cuda"
    synchronize(device)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if cuda else 0
    profiler = profiled(device, profile_memory=True) \
        if timeline or not cuda else contextlib.nullcontext()
    with profiler as prof:
        t0 = time.perf_counter_ns()
        result = fn()
        synchronize(device)
        seconds = (time.perf_counter_ns() - t0) / 1e9
    times, levels, ops = live_bytes(prof, device) if prof is not None else ([], [], [])
    if cuda:
        peak, left = torch.cuda.max_memory_allocated() - base, torch.cuda.memory_allocated() - base
    else:
        peak, left = max([0] + levels), (levels[-1] if levels else 0)
    return Allocations(result, peak, left, seconds, times, levels, ops)


def live_bytes(prof, device: str):
    """Live-byte levels of `device` in time order, each with the op that allocated or freed;
    times in ms from the first profiled event."""
    kind = "CUDA" if device == "cuda" else "CPU"
    events = prof.profiler.kineto_results.events()
    ops = sorted((e.start_ns(), e.end_ns(), e.name()) for e in events if e.name() != "[memory]")
    mem = sorted((e.start_ns(), e.nbytes()) for e in events
                 if e.name() == "[memory]" and kind in str(e.device_type()))
    # Kineto stamps events with its own (wall-clock) time base, not perf_counter's: count from
    # the first event it recorded.
    start = min([o[0] for o in ops[:1]] + [m[0] for m in mem[:1]], default=0)
    live, times, levels, names = 0, [], [], []
    for t, nbytes in mem:
        live += nbytes
        times.append((t - start) / 1e6)
        levels.append(live)
        names.append(_innermost_op(ops, t))
    return times, levels, names


def _innermost_op(ops, t: int) -> str:
    best = None
    for start, end, name in ops:
        if start > t:
            break
        if end >= t and (best is None or end - start < best[0]):
            best = (end - start, name)
    return best[1] if best else "(outside any profiled op)"


def cuda_usage() -> tuple[int, int]:
    """(bytes the CUDA device has in use, bytes PyTorch's allocator has reserved): taken
    before a model exists, so that `non_torch_bytes` can tell what grew outside PyTorch."""
    free, total = torch.cuda.mem_get_info()
    return total - free, torch.cuda.memory_reserved()


def non_torch_bytes(device: str, before: tuple[int, int] | None) -> int | None:
    """CUDA memory used beyond what PyTorch's allocator reserved, grown since `before`
    (`cuda_usage()`); None on the CPU or without `before`."""
    if device != "cuda" or before is None:
        return None
    used, reserved = cuda_usage()
    return max(0, (used - before[0]) - (reserved - before[1]))


def probe_measurement(device: str, nbytes: int = 64 * MiB) -> int:
    """Allocate and free a tensor of `nbytes`; return the peak this machine's method measured:
    the setup check that memory measurement works here (it must equal `nbytes`)."""
    return measure_allocations(
        lambda: torch.ones(nbytes, dtype=torch.uint8, device=device).numel(), device,
        timeline=False).peak_bytes
