"""Chapter 04's decode step against context length: a full-attention layer reads every token a
request holds, a sliding-window layer at most its window, so once the context passes the
window the windowed model's step stops growing.

The run's model and the same shape with the other kind of attention (every layer sliding over
`window` tokens when the model has none; every layer full when it has windows) each decode
eagerly from prompts of every length, the variants and lengths taking turns repeat by repeat,
each step timed, beside the bandwidth floor of that step (`decode_step_cost`).
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field

import torch

from kit.config import Settings
from kit.engine.decode import blocks_needed, generate, make_prompts, new_batch
from kit.engine.kv_cache import KVCacheSpec, allocate
from kit.engine.kv_groups import layer_windows, with_layer_pattern
from kit.engine.model import build_model
from kit.measure.roofline import decode_step_cost
from kit.measure.throughput import copy_bandwidth

STEPS = 4  # decode steps timed per run


@dataclass
class ContextCurve:
    """One variant's median step time at each context length, with its floor."""

    label: str
    windows: tuple
    lengths: list[int]
    steps: dict[int, list[float]] = field(default_factory=dict)  # length -> step seconds
    floors: list[float] = field(default_factory=list)

    @property
    def medians(self) -> list[float]:
        return [statistics.median(self.steps[n]) for n in self.lengths]

    def summary(self) -> dict:
        return {"label": self.label, "lengths": self.lengths, "median_seconds": self.medians,
                "floor_seconds": self.floors}


def variants(arch, window: int) -> dict[str, object]:
    """The model as configured, and the same shape with the other kind of attention."""
    if layer_windows(arch):
        return {"as configured (sliding windows)": arch,
                "all full attention": with_layer_pattern(arch, 1)}
    return {"as configured (full attention)": arch,
            f"every layer sliding over {window:,} tokens": with_layer_pattern(arch, None, window)}


def context_lengths(settings: Settings, count: int = 5) -> list[int]:
    """Prompt lengths doubling up to the longest the settings allow (max_model_len less the
    steps), `count` of them at most."""
    top = settings.max_model_len - STEPS - 1
    return sorted({max(8, top >> k) for k in range(count)})


@torch.no_grad()
def time_run(model, arch, settings: Settings, length: int) -> list[float]:
    """Step seconds of one eager run: `batch_size` prompts of `length` tokens, STEPS steps."""
    lengths = [length] * settings.batch_size
    spec = KVCacheSpec.for_model(arch, settings.block_size, settings.dtype)
    cache = allocate(spec, blocks_needed(lengths, STEPS, settings.block_size), settings.dtype,
                     settings.device)
    prompts = make_prompts(lengths, arch.vocab_size, settings.seed)
    run = generate(model, new_batch(cache, lengths, STEPS), prompts, STEPS, keep_logits=False)
    return run.step_seconds


def step_time_by_context(settings: Settings, window: int | None = None, repeats: int = 3,
                         progress=None) -> list[ContextCurve]:
    """Every variant timed at every length (`context_lengths`), `repeats` interleaved runs."""
    lengths = context_lengths(settings)
    window = window or max(16, lengths[-1] // 8)
    archs = variants(settings.arch, window)
    models = {k: build_model(a, settings.dtype, settings.device, settings.seed)
              for k, a in archs.items()}
    curves = [ContextCurve(k, layer_windows(a), lengths) for k, a in archs.items()]
    for r in range(repeats + 1):  # the first round warms up and is not kept
        for n in lengths:
            for curve in curves:
                seconds = time_run(models[curve.label], archs[curve.label], settings, n)
                if r:
                    curve.steps.setdefault(n, []).extend(seconds)
        if progress:
            progress(f"round {r} of {repeats} done" + (" (warm-up)" if not r else ""))
    bandwidth = copy_bandwidth(settings.device, 0.5).rate
    for curve in curves:
        kv = KVCacheSpec.for_model(archs[curve.label], settings.block_size, settings.dtype)
        curve.floors = [decode_step_cost(archs[curve.label], settings.dtype_bytes,
                                         kv.bytes_per_token, [n + STEPS // 2 + 1] * settings.batch_size,
                                         curve.windows).floor_seconds(bandwidth)
                        for n in lengths]
    return curves
