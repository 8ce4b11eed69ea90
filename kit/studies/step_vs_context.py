"""Chapter 04's decode step against context length: a full-attention layer reads every token a
request holds, a sliding-window layer at most its window, so once the context passes the
window the windowed model's step stops growing.

The run's model and the same shape with the other kind of attention (every layer sliding over
`window` tokens when the model has none; every layer full when it has windows) each decode
eagerly from prompts of every length, the variants taking turns round by round, each step
timed, beside the bandwidth floor of a step at that context (`decode_step_cost`).
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field

import torch

from kit.config import Settings, with_layer_pattern
from kit.engine.decode import batch_for_run, make_prompts, step_for
from kit.engine.kv_cache import KVCacheLayout
from kit.engine.model import build_model
from kit.measure.roofline import decode_step_cost
from kit.measure.throughput import copy_bandwidth
from kit.measure.timing import StepClock, Timings, spread_warning
from kit.units import Count, Seconds, fmt_bytes

STEPS = 4  # decode steps timed per round


@dataclass
class ContextCurve:
    """One variant's median step time at each context length, with its floor, and the blocks
    its batch held after its last step there (a sliding layer hands back what left its
    window, so a windowed model's cache stops growing too)."""

    label: str
    layout: KVCacheLayout
    lengths: list[int]
    steps: dict[int, list[float]] = field(default_factory=dict)  # length -> step seconds
    floors: list[float] = field(default_factory=list)
    held: list[int] = field(default_factory=list)  # blocks held, per length

    @property
    def medians(self) -> list[float]:
        return [statistics.median(self.steps[n]) for n in self.lengths]

    @property
    def held_bytes(self) -> list[int]:
        """What the blocks held cost: a block id is a page in each layer of the widest group,
        so two layouts' blocks differ in bytes (a window's CPU blocks of 32 tokens against
        full attention's 16; Gemma 4's one-layer groups against a variant's one group)."""
        return [n * self.layout.bytes_per_block for n in self.held]

    def timing_warnings(self) -> dict[str, str]:
        """Each context length whose steps spread too wide to trust their median
        (`kit.measure.timing.spread_warning`), by "label, N tokens"."""
        found = {f"{self.label}, {n:,} tokens": spread_warning(self.steps[n])
                 for n in self.lengths}
        return {k: v for k, v in found.items() if v}

    def quantiles(self, q: float) -> list[float]:
        """The q-quantile of the steps timed at each length (`Timings.quantile`)."""
        return [Timings(self.steps[n]).quantile(q) for n in self.lengths]

    def summary(self) -> dict:
        return {"label": self.label, "lengths": Count.of(self.lengths),
                "blocks_held": Count.of(self.held),
                **Seconds.of({"median_seconds": self.medians, "floor_seconds": self.floors})}


def held_detail(windowed: ContextCurve, full: ContextCurve) -> str:
    """The blocks each batch held at the longest context, and their bytes where the windowed
    one held more block ids than the full one (`ContextCurve.held_bytes`)."""
    line = f"{windowed.held[-1]:,} against {full.held[-1]:,} blocks at {full.lengths[-1]:,} tokens"
    if windowed.held[-1] < full.held[-1]:
        return line
    return (f"{line} ({fmt_bytes(windowed.held_bytes[-1])} against "
            f"{fmt_bytes(full.held_bytes[-1])}: its blocks cost less)")


def variants(arch, window: int) -> dict[str, object]:
    """The model as configured, and the same shape with the other kind of attention; a
    latent attention model alone (its layers take no window: vLLM's MLA has none), and a
    hybrid alone (its recurrent layers read a fixed state whatever the context)."""
    if arch.latent_size:
        return {"as configured (latent attention)": arch}
    if arch.recurrent:
        return {"as configured (recurrent and attention layers)": arch}
    if any(arch.window(i) for i in range(arch.num_hidden_layers)):
        return {"as configured (sliding windows)": arch,
                "all full attention": with_layer_pattern(arch, 1)}
    return {"as configured (full attention)": arch,
            f"every layer sliding over {window:,} tokens": with_layer_pattern(arch, None, window)}


def context_lengths(settings: Settings, steps: int, count: int = 5) -> list[int]:
    """Prompt lengths doubling up to the longest the settings allow (max_model_len less the
    `steps` that follow), `count` of them at most."""
    top = settings.max_model_len - steps
    return sorted({max(8, top >> k) for k in range(count)})


class PrefilledRun:
    """One variant's batch at one length: `batch_size` prompts of `length` tokens prefilled
    once, then decode steps timed a few at a time (the context grows a token a step)."""

    def __init__(self, model, layout: KVCacheLayout, settings: Settings, length: int,
                 steps: int):
        lengths = [length] * settings.batch_size
        self.batch = batch_for_run(layout, lengths, steps, settings.device)
        self.device = settings.device
        self.batch.start(model, make_prompts(lengths, model.arch.vocab_size, settings.seed))
        self.step = step_for(model, self.batch)

    @torch.no_grad()
    def time_steps(self, count: int) -> list[float]:
        clock = StepClock(self.device)
        for _ in range(count):
            clock.start()
            self.batch.step(self.step)
            clock.stop()
        return clock.seconds()


def step_time_by_context(settings: Settings, window: int | None = None, repeats: int = 3,
                         progress=None) -> list[ContextCurve]:
    """Every variant timed at every length (`context_lengths`): at each length the variants
    are prefilled once, then take turns for `repeats` rounds of STEPS steps (one more round
    first, not kept, warms up)."""
    lengths = context_lengths(settings, STEPS * (repeats + 1))
    window = window or max(16, lengths[-1] // 8)
    archs = variants(settings.arch, window)
    models = {k: build_model(a, settings.dtype, settings.device, settings.seed)
              for k, a in archs.items()}
    # each variant's KV cache at the run's block size, on the run's device
    curves = [ContextCurve(k, KVCacheLayout.for_model(a, settings.block_size, settings.dtype,
                                                      device=settings.device), lengths)
              for k, a in archs.items()]
    for n in lengths:
        runs = {c.label: PrefilledRun(models[c.label], c.layout, settings, n,
                                      STEPS * (repeats + 1)) for c in curves}
        for r in range(repeats + 1):
            for curve in curves:
                seconds = runs[curve.label].time_steps(STEPS)
                if r:
                    curve.steps.setdefault(n, []).extend(seconds)
        for curve in curves:
            curve.held.append(runs[curve.label].batch.held[-1])
        if progress:
            progress(f"context {n:,}: " + ", ".join(
                f"{c.label} {statistics.median(c.steps[n]) * 1e3:.2f} ms" for c in curves))
    bandwidth = copy_bandwidth(settings.device, 0.5).rate
    for curve in curves:
        curve.floors = [decode_step_cost(archs[curve.label], settings.dtype_bytes,
                                         curve.layout.specs, [n + STEPS] * settings.batch_size
                                         ).floor_seconds(bandwidth) for n in lengths]
    return curves
