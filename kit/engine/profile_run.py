"""vLLM's profile run, as the engine does it before sizing the KV cache: load the weights, run
one forward at `max_num_batched_tokens` (plus the logits of one token per sequence, as the sampler
would), and take the peak. What is left of capacity × gpu_memory_utilization after weights, peak
activations and non-torch memory is the KV cache budget.

The profile runs eagerly, or compiled through a runner (`kit.engine.runners`) whose compilation
is thrown away afterwards with `discard()`, as vLLM #7796 does. Chapter 01 teaches it; chapters
02 (the budget), 03 (each plan's profile), 04 (the decode budget) and 05 use the same profile,
or chapter 01's recorded one when it profiled the same settings; every one of them measures
through `profile_run`, which first warms cuBLAS up (`warm_up_blas`), so that its workspaces
are in the baseline of every profile rather than in the peak of whichever ran the process's
first product.
"""
from __future__ import annotations

import gc
from dataclasses import dataclass, field

import torch

from kit.config import Settings
from kit.engine.budget import MemoryBudget, weights_budget
from kit.engine.model import Decoder, build_model, dummy_batch, weights_bytes
from kit.engine.runners import Runner, make_runner
from kit.errors import ConfigError
from kit.measure.device import capacity_bytes, synchronize, torch_dtype
from kit.measure.memory import cuda_usage, measure_allocations, non_torch_bytes
from kit.units import Bytes, Count, Fraction, GiB, Seconds

# The chapter's two profiles, and the strategy that runs each one's profiling forward.
PROFILES = {"eager": "eager", "compiled": "stock"}


@dataclass
class MemoryProfile:
    """What one profiling run measured, in bytes. `kv_cache_bytes` is what vLLM would give the
    KV cache: budget - weights - peak activations - non-torch."""

    name: str
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
    def budget(self) -> MemoryBudget:
        """This profile's split of the budget (`kit.engine.budget`)."""
        return MemoryBudget(self.capacity_bytes, self.gpu_memory_utilization, self.weights_bytes,
                            self.peak_activation_bytes, self.non_torch_bytes or 0)

    @property
    def budget_bytes(self) -> int:
        return self.budget.budget_bytes

    @property
    def peak_bytes(self) -> int:
        return self.weights_bytes + self.input_bytes + self.peak_activation_bytes

    @property
    def non_kv_cache_bytes(self) -> int:
        return self.budget.non_kv_cache_bytes

    @property
    def kv_cache_bytes(self) -> int:
        return self.budget.kv_cache_bytes

    def summary(self) -> dict:
        kinds = {"name": str, "device": str, "num_tokens": Count, "num_seqs": Count,
                 "weights_bytes": Bytes, "input_bytes": Bytes, "peak_activation_bytes": Bytes,
                 "non_torch_bytes": Bytes, "capacity_bytes": Bytes,
                 "gpu_memory_utilization": Fraction, "budget_bytes": Bytes,
                 "kv_cache_bytes": Bytes, "compile_seconds": Seconds, "forward_seconds": Seconds}
        return {k: getattr(self, k) if kind is str else kind.of(getattr(self, k))
                for k, kind in kinds.items()}


def check_fits(settings: Settings) -> None:
    """Refuse before loading anything when the weights alone exceed the budget."""
    split = weights_budget(settings.arch, settings.dtype,
                           capacity_bytes(settings.device, settings.device_memory),
                           settings.gpu_memory_utilization)
    need, budget = split.weights_bytes, split.budget_bytes
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


def profile_batch(settings: Settings) -> torch.Tensor:
    """The profiling run's input ids: max_num_batched_tokens over up to max_num_seqs sequences."""
    return dummy_batch(settings.max_num_batched_tokens, settings.max_num_seqs,
                       settings.arch.vocab_size, settings.device, settings.seed)


def warm_up_blas(device: str, dtype: str) -> None:
    """One product of each kind the model runs, in its dtype, on the current stream (where
    the profiles run): a plain one (cuBLAS) and one with a bias (cuBLASLt's addmm).

    PyTorch allocates cuBLAS's workspace (CUBLAS_WORKSPACE_CONFIG; 32 MiB on Hopper) and
    cuBLASLt's through its caching allocator at the first product on a handle and stream, and
    keeps them for the process (aten/src/ATen/cuda/CublasHandlePool.cpp). Left to the model,
    they would count in the peak of the first profile only, the eager one, and bias compiled ÷
    eager, the ratio chapter 01 teaches (vLLM #7796). Warmed here, they are in every profile's
    baseline. Nothing to warm on the CPU: nothing runs there, and its numbers stay as they were."""
    if device != "cuda":
        return
    x = torch.ones(64, 64, dtype=torch_dtype(dtype), device=device)
    torch.nn.functional.linear(x, x)
    torch.nn.functional.linear(x, x, x[0])
    synchronize(device)


def profile_run(model: Decoder, settings: Settings, name: str, weights: int,
                before=None, runner: Runner | None = None) -> MemoryProfile:
    """Profile one forward of `model` at max_num_batched_tokens, and the sampler's logits,
    through `runner` (already warm; its first call compiled it) or eagerly without one. `name`
    names the result; `before` is `cuda_usage()` taken before the model existed (GPU)."""
    device, step = settings.device, runner or model.forward
    ids = profile_batch(settings)
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()

    def forward():
        hidden = step(ids)
        model.compute_logits(hidden[:, -1])  # the sampler's share: one position per sequence
    warm_up_blas(device, settings.dtype)  # before the baseline `measure_allocations` takes
    measured = measure_allocations(forward, device)
    return MemoryProfile(
        name=name, device=device, num_tokens=ids.numel(), num_seqs=ids.shape[0],
        weights_bytes=weights, input_bytes=ids.numel() * ids.element_size(),
        peak_activation_bytes=measured.peak_bytes,
        non_torch_bytes=non_torch_bytes(device, before),
        capacity_bytes=capacity_bytes(device, settings.device_memory),
        gpu_memory_utilization=settings.gpu_memory_utilization,
        compile_seconds=runner.compile_seconds if runner else 0.0,
        forward_seconds=measured.seconds, timeline_ms=measured.timeline_ms,
        timeline_bytes=measured.timeline_bytes, timeline_ops=measured.timeline_ops)


def profile_memory(settings: Settings, profiles: dict = PROFILES,
                   arch=None) -> dict[str, MemoryProfile]:
    """Load the model once and profile it each way (`profiles`: name -> strategy), side by side
    in one process. A compiled profile's runner compiles first (its time reported apart) and is
    discarded after its measurement: the profiling compilation is thrown away, as in vLLM #7796.
    `arch`: a shape to profile instead of the settings' model (chapter 01's one layer of it)."""
    check_fits(settings)
    gc.collect()
    before = cuda_usage() if settings.device == "cuda" else None
    model = build_model(arch or settings.arch, settings.dtype, settings.device, settings.seed)
    weights = weights_bytes(model)
    results = {}
    with torch.inference_mode():
        for name, strategy in profiles.items():
            runner = None if strategy == "eager" else make_runner(
                model.forward, strategy, settings.device, (profile_batch(settings),))
            results[name] = profile_run(model, settings, name, weights, before, runner)
            if runner is not None:
                runner.discard()
    return results


# The settings a memory profile depends on.
PROFILE_KEYS = ("model", "device", "dtype", "max_num_batched_tokens", "max_num_seqs",
                "gpu_memory_utilization", "device_memory", "seed")


def recorded_profiles(settings: Settings, recorded: dict | None) -> dict[str, dict] | None:
    """Chapter 01's profile summaries from its record (`recorded`), if it profiled these
    settings; else None."""
    if recorded is None:
        return None
    same = all(recorded["settings"].get(k) == getattr(settings, k) for k in PROFILE_KEYS)
    if same and all(name in recorded["results"] for name in PROFILES):
        return {name: recorded["results"][name] for name in PROFILES}
    return None


def recorded_eager_kv_bytes(settings: Settings, recorded: dict | None) -> int | None:
    """What chapter 01's recorded eager profile left the KV cache, for these settings."""
    profiles = recorded_profiles(settings, recorded)
    return None if profiles is None else profiles["eager"]["kv_cache_bytes"]


def recorded_or_measured(settings: Settings, recorded: dict | None,
                         progress=lambda line: None) -> tuple[dict[str, dict], str]:
    """Chapter 01's profile summaries for these settings: from `recorded` (chapter 01's record
    in this run's folder, or None) when it holds them for the same settings, else measured now
    (saying so through `progress` first: it takes chapter 01's time)."""
    profiles = recorded_profiles(settings, recorded)
    if profiles is not None:
        return profiles, f"read from {recorded['chapter']}.json"
    why = "not in this run's folder" if recorded is None else "recorded for other settings"
    progress(f"chapter 01's memory profile is {why}: measuring it now, eager and compiled "
             f"(chapter 01's time; run chapter 01 first to skip this) ...")
    return {k: p.summary() for k, p in profile_memory(settings).items()}, "measured now"
