"""Memory profiling as vLLM does it (chapter 01).

Load the weights, run one forward at `max_num_batched_tokens` (plus the logits of one token
per sequence, as the sampler would), and take the peak. What is left of
capacity × gpu_memory_utilization after weights, peak activations and non-torch memory is the
KV cache budget.

On CUDA the peak comes from the caching allocator's statistics and non-torch memory from
`cudaMemGetInfo`. On the CPU there is no allocator counter, so the peak is integrated from
`torch.profiler`'s memory events, which also see the buffers Inductor-compiled code allocates
(a dispatch-level tracker would miss those). Both devices record a timeline of live bytes.
"""
from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field

import torch
from torch.profiler import ProfilerActivity, profile

from kit.config import ConfigError, Settings
from kit.device import capacity_bytes, synchronize
from kit.model import Decoder, build_model, dummy_batch, weights_bytes

GiB = 2**30
STRATEGIES = ("eager", "compiled")


@dataclass
class MemoryProfile:
    """What one profiling run measured, in bytes. `kv_cache_bytes` is what vLLM would give the
    KV cache: budget - weights - peak activations - non-torch."""

    strategy: str
    device: str
    num_tokens: int
    num_seqs: int
    weights_bytes: int
    input_bytes: int
    peak_activation_bytes: int
    non_torch_bytes: int | None
    capacity_bytes: int
    gpu_memory_utilization: float
    compile_seconds: float
    forward_seconds: float
    timeline_ms: list[float] = field(repr=False, default_factory=list)
    timeline_bytes: list[int] = field(repr=False, default_factory=list)
    timeline_ops: list[str] = field(repr=False, default_factory=list)

    @property
    def budget_bytes(self) -> int:
        return int(self.capacity_bytes * self.gpu_memory_utilization)

    @property
    def peak_bytes(self) -> int:
        return self.weights_bytes + self.input_bytes + self.peak_activation_bytes

    @property
    def non_kv_cache_bytes(self) -> int:
        return self.weights_bytes + self.peak_activation_bytes + (self.non_torch_bytes or 0)

    @property
    def kv_cache_bytes(self) -> int:
        return self.budget_bytes - self.non_kv_cache_bytes

    def summary(self) -> dict:
        keys = ("strategy", "device", "num_tokens", "num_seqs", "weights_bytes", "input_bytes",
                "peak_activation_bytes", "non_torch_bytes", "capacity_bytes",
                "gpu_memory_utilization", "budget_bytes", "kv_cache_bytes", "compile_seconds",
                "forward_seconds")
        return {k: getattr(self, k) for k in keys}


def check_fits(settings: Settings) -> None:
    """Refuse before loading anything when the weights alone exceed the budget."""
    need = settings.arch.num_parameters() * settings.dtype_bytes
    budget = int(capacity_bytes(settings.device, settings.device_memory)
                 * settings.gpu_memory_utilization)
    if need >= budget:
        raise ConfigError(
            f"{settings.arch.name} needs {need / GiB:.2f} GiB of weights in {settings.dtype}, "
            f"but the budget (capacity × gpu_memory_utilization) is {budget / GiB:.2f} GiB: "
            f"{(need - budget) / GiB:.2f} GiB missing. Raise device_memory or "
            "gpu_memory_utilization, or pick a smaller model.")


def no_kv_cache_message(p: MemoryProfile) -> str:
    return (f"No available memory for the cache blocks: the budget of {p.budget_bytes / GiB:.2f} "
            f"GiB is {-p.kv_cache_bytes / GiB:.2f} GiB short of weights + peak activations"
            f"{' + non-torch memory' if p.non_torch_bytes else ''} "
            f"({p.non_kv_cache_bytes / GiB:.2f} GiB). Raise gpu_memory_utilization or "
            "device_memory, or lower max_num_batched_tokens.")


def _profile_step(model: Decoder, step, input_ids: torch.Tensor) -> None:
    hidden = step(input_ids)
    model.compute_logits(hidden[:, -1])  # the sampler's share: one position per sequence


def _timeline(prof, device: str, t0_ns: int):
    """Live-byte deltas of `device` in time order, each with the op that allocated or freed."""
    kind = "CUDA" if device == "cuda" else "CPU"
    events = prof.profiler.kineto_results.events()
    ops = sorted((e.start_ns(), e.end_ns(), e.name()) for e in events if e.name() != "[memory]")
    mem = sorted((e.start_ns(), e.nbytes()) for e in events
                 if e.name() == "[memory]" and kind in str(e.device_type()))
    live, times, levels, names = 0, [], [], []
    for t, nbytes in mem:
        live += nbytes
        times.append((t - t0_ns) / 1e6)
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


def _non_torch_bytes(device: str, before: tuple[int, int]) -> int | None:
    """CUDA memory used beyond what PyTorch's allocator reserved, grown since `before`."""
    if device != "cuda":
        return None
    free, total = torch.cuda.mem_get_info()
    used_delta = (total - free) - before[0]
    return max(0, used_delta - (torch.cuda.memory_reserved() - before[1]))


def _cuda_usage() -> tuple[int, int]:
    free, total = torch.cuda.mem_get_info()
    return total - free, torch.cuda.memory_reserved()


def profile_batch(settings: Settings) -> torch.Tensor:
    """The profiling run's input ids: max_num_batched_tokens over up to max_num_seqs sequences."""
    return dummy_batch(settings.max_num_batched_tokens, settings.max_num_seqs,
                       settings.arch.vocab_size, settings.device, settings.seed)


def profile_run(model: Decoder, settings: Settings, strategy: str, weights: int,
                before=None, step=None) -> MemoryProfile:
    """Profile one forward of `model` at max_num_batched_tokens, eager or compiled. `step`
    (chapter 03) profiles that callable instead, already warmed up by the caller (e.g. one of
    kit.compile's runners); `strategy` then only names the result."""
    if step is None and strategy not in STRATEGIES:
        raise ConfigError(f"strategy={strategy!r}: use one of {STRATEGIES}")
    device = settings.device
    ids = profile_batch(settings)
    compile_s, given = 0.0, step is not None
    step = step if given else model.forward
    if strategy == "compiled" and not given:
        step = torch.compile(model.forward)
        t = time.perf_counter()
        _profile_step(model, step, ids)  # compile outside the measurement, as a warm-up
        synchronize(device)
        compile_s = time.perf_counter() - t
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    base_allocated = torch.cuda.memory_allocated() if device == "cuda" else 0
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities, profile_memory=True) as prof:
        t0 = time.perf_counter_ns()
        _profile_step(model, step, ids)
        synchronize(device)
        forward_s = (time.perf_counter_ns() - t0) / 1e9
    times, levels, names = _timeline(prof, device, t0)
    if device == "cuda":
        peak = torch.cuda.max_memory_allocated() - base_allocated
    else:
        peak = max([0] + levels)
    capacity = capacity_bytes(device, settings.device_memory)
    return MemoryProfile(
        strategy=strategy, device=device, num_tokens=ids.numel(), num_seqs=ids.shape[0],
        weights_bytes=weights, input_bytes=ids.numel() * ids.element_size(),
        peak_activation_bytes=peak,
        non_torch_bytes=_non_torch_bytes(device, before) if before else None,
        capacity_bytes=capacity, gpu_memory_utilization=settings.gpu_memory_utilization,
        compile_seconds=compile_s, forward_seconds=forward_s,
        timeline_ms=times, timeline_bytes=levels, timeline_ops=names)


def profile_memory(settings: Settings, strategies=STRATEGIES) -> dict[str, MemoryProfile]:
    """Load the model once and profile it with each strategy, side by side in one process."""
    check_fits(settings)
    gc.collect()
    before = _cuda_usage() if settings.device == "cuda" else None
    model = build_model(settings.arch, settings.dtype, settings.device, settings.seed)
    weights = weights_bytes(model)
    results = {}
    with torch.inference_mode():
        for strategy in strategies:
            results[strategy] = profile_run(model, settings, strategy, weights, before)
            torch._dynamo.reset()  # the profiling compilation is thrown away, as in the seed
    return results


def probe_measurement(device: str, nbytes: int = 64 * 2**20) -> int:
    """Allocate a tensor of `nbytes` and return the peak this machine's method measured: the
    setup check that memory measurement works here (it must equal `nbytes`)."""
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        x = torch.ones(nbytes, dtype=torch.uint8, device=device)
        del x
        return torch.cuda.max_memory_allocated() - base
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        t0 = time.perf_counter_ns()
        x = torch.ones(nbytes, dtype=torch.uint8)
        del x
    return max([0] + _timeline(prof, device, t0)[1])
