"""Chapter 04, decode timing per strategy against the roofline (also `python -m kit bench decode`).

`run_decode(settings)` checks the request first (nothing heavy before the errors a learner can
fix), builds the model, sizes the KV budget (kv_cache_memory_bytes, else what chapter 01's
eager memory profile leaves: read from chapter 01's record in the run folder when it profiled
the same settings, else measured; it needs no compilation), measures the device's copy
bandwidth and matmul throughput (bounded to about a second each, float32's too when the run is
16-bit, to say whether its dtype is emulated here), checks a batch of mixed prompt lengths
against the no-cache reference, then times every strategy: a warm-up run (compilation, CUDA
graph capture) reported apart, and a timed run of `output_len - 1` decode steps after the
prefill, each step timed and its logits checked against the reference; `num_iters` timed runs
per strategy, interleaved.
"""
from __future__ import annotations

import os
import statistics
from dataclasses import dataclass, field

import torch

from kit.config import Settings, reference
from kit.engine.decode import PagedBatch, decode_inputs, generate
from kit.engine.decode_fit import CacheFit, decode_budget, early_fit, fit_in_cache
from kit.engine.decode_runners import SharedPrefill, warm_up
from kit.engine.no_cache import Correctness
from kit.engine.runners import CompiledGraphs
from kit.engine.expert_picks import moe_layers, record_picks
from kit.engine.kv_cache import KVCacheLayout, allocate
from kit.engine.layers.attention import summed_attention
from kit.engine.routing_replay import check_routed_against_no_cache
from kit.engine.model import Decoder, build_model, weights_bytes
from kit.measure.device import cpu_kind, describe, versions
from kit.measure.dtype_speed import DtypeSpeed, beside_float32, hardware_figures
from kit.measure.memory import cuda_usage
from kit.measure.roofline import DeviceLimits, StepCost, decode_step_cost, measure_limits
from kit.measure.throughput import copy_bandwidth
from kit.measure.step_breakdown import StepBreakdown, break_down_steps
from kit.measure.timing import Timings, load_warning, spread_warning, verdict_line
from kit.units import (Count, FlopPerSecond, Number, Percent, Ratio, Seconds, TokensPerSecond,
                       fmt_flops)

BREAKDOWN_STEPS = 3  # per strategy, after the timed runs, to split a step into its parts
RESAMPLE_SECONDS = 0.5  # the copy measured again after each round of timed runs


@dataclass
class StrategyTiming:
    """One strategy's decode runs: warm-up (compilation included) apart from the timed runs,
    each a prefill then every decode step timed."""

    strategy: str
    num_seqs: int
    compile_seconds: float = 0.0   # the first call of the step: it compiles
    reused_from: str | None = None  # the strategy that compiled the graph it took (None: its own)
    capture_seconds: float = 0.0   # cuda_graphs: the warm-up call and capture after the compile
    warmup_seconds: float = 0.0    # the whole warm-up run: its prefill, steps and compilation
    graphs_compiled: int = 0       # Inductor graphs behind the runner: 1 means no recompile
    guards: int = 0                # guards Dynamo evaluates on each call of the served code
    prefill: str = "eager"         # how its prefill ran: "eager" or "compiled" (the CPU's)
    runs: list[list[float]] = field(default_factory=list)   # [run][step] seconds
    prefills: list[float] = field(default_factory=list)     # [run] seconds
    correctness: Correctness | None = None                  # of the first timed run
    floor_seconds: list[float] = field(default_factory=list)  # per step, from the roofline
    breakdown: StepBreakdown | None = None                  # a few steps, profiled apart

    def warmup_line(self) -> str:
        """The warm-up's parts: "compile 1.20 s, warm-up 1.50 s", the CUDA graph's capture
        between them when one was captured, and whose graph the compile took when it only
        traced with Dynamo (`reused_from`)."""
        reused = (f" (Dynamo's trace; Inductor's graph from {self.reused_from})"
                  if self.reused_from else "")
        capture = (f"CUDA graph capture {self.capture_seconds:.2f} s, "
                   if self.capture_seconds else "")
        return (f"compile {self.compile_seconds:.2f} s{reused}, {capture}"
                f"warm-up {self.warmup_seconds:.2f} s")

    @property
    def samples(self) -> Timings:
        """Every step of every timed run."""
        return Timings([s for run in self.runs for s in run])

    @property
    def step_seconds(self) -> list[float]:
        """Each step's median over the timed runs: the line to plot over the steps."""
        return [statistics.median(times) for times in zip(*self.runs)]

    @property
    def median(self) -> float:
        return self.samples.median

    @property
    def p10(self) -> float:
        return self.samples.quantile(0.1)

    @property
    def p90(self) -> float:
        return self.samples.quantile(0.9)

    @property
    def spread(self) -> float:
        """p90 - p10 of the step times."""
        return self.samples.spread

    @property
    def prefill_seconds(self) -> float:
        return statistics.median(self.prefills)

    @property
    def end_to_end_seconds(self) -> float:
        """Prefill plus every step, the median over the timed runs."""
        return statistics.median(p + sum(run) for p, run in zip(self.prefills, self.runs))

    @property
    def tokens_per_second(self) -> float:
        """Generated tokens (the prefill's one and each step's) per second, end to end."""
        return self.num_seqs * (len(self.runs[0]) + 1) / self.end_to_end_seconds

    @property
    def median_floor_seconds(self) -> float | None:
        """The bandwidth floor of the median step (the floor grows with the context, step by
        step, so the median of the floors is the median step's)."""
        return statistics.median(self.floor_seconds) if self.floor_seconds else None

    @property
    def percent_of_floor(self) -> float | None:
        """The floor as % of the median step, both as the tables show them (floor ÷ median):
        100% means the step moves its bytes as fast as a plain copy does; over 100%, a step
        faster than its floor, is a measurement to repeat (`faster_than_floor`)."""
        if not self.floor_seconds:
            return None
        return 100 * self.median_floor_seconds / self.median

    @property
    def faster_than_floor(self) -> bool:
        """A median step under its bandwidth floor: the copy bandwidth was measured low (a busy
        neighbour during its probe), or the step moved fewer bytes than counted. Repeat it."""
        return bool(self.percent_of_floor and self.percent_of_floor > 100)

    def summary(self) -> dict:
        return {"strategy": self.strategy, "prefill": self.prefill,
                "graph_reused_from": self.reused_from,
                "graphs_compiled": Count.of(self.graphs_compiled), "guards": Count.of(self.guards),
                **Seconds.of({"compile_seconds": self.compile_seconds,
                              "capture_seconds": self.capture_seconds,
                              "warmup_seconds": self.warmup_seconds,
                              "prefill_seconds": self.prefill_seconds,
                              "median_step_seconds": self.median, "p10_step_seconds": self.p10,
                              "p90_step_seconds": self.p90, "spread_seconds": self.spread,
                              "end_to_end_seconds": self.end_to_end_seconds,
                              "step_seconds": self.step_seconds,
                              "floor_seconds": self.floor_seconds, "runs_step_seconds": self.runs,
                              "runs_prefill_seconds": self.prefills}),
                "tokens_per_second": TokensPerSecond.of(self.tokens_per_second),
                "percent_of_floor": Percent.of(self.percent_of_floor),
                "correctness": self.correctness.summary() if self.correctness else None,
                "breakdown": self.breakdown.summary() if self.breakdown else None}


def time_strategies(model: Decoder, batch: PagedBatch, prompts: list[torch.Tensor],
                    steps: int, strategies, dtype: str, num_iters: int,
                    progress=print, after_round=None,
                    breakdown_steps: int = BREAKDOWN_STEPS) -> dict[str, StrategyTiming]:
    """Warm every strategy up, then `num_iters` rounds in which each strategy in turn runs
    the whole generation timed, so a noisy neighbour slows every strategy alike rather than
    whichever ran at the time; `after_round` is called after each round. The first timed run
    of each is checked against the reference; then `breakdown_steps` more steps of each are
    profiled (none: no breakdown). The compiled strategies prefill through `SharedPrefill`,
    and the first of them compiles the step for all (`CompiledGraphs`): they differ in how a
    call reaches the compiled graph, which is what the timed runs compare."""
    runners, timings, prefills = {}, {}, {}
    shared, graphs = SharedPrefill(model, batch, prompts, progress), CompiledGraphs()
    for i, name in enumerate(strategies, 1):
        prefills[name] = shared.for_strategy(name)
        progress(f"[{i}/{len(strategies)}] {name}: warming up (compiling) ...")
        runner, seconds = warm_up(model, batch, prompts, steps, name, prefills[name],
                                  shared=graphs)
        runners[name] = runner
        timings[name] = StrategyTiming(
            name, len(prompts), compile_seconds=runner.compile_seconds,
            reused_from=runner.reused_from,
            capture_seconds=runner.capture_seconds, warmup_seconds=seconds,
            graphs_compiled=runner.graphs_compiled, guards=sum(runner.guards()[:1]),
            prefill="eager" if prefills[name] is None else "compiled")
        progress(f"  {timings[name].warmup_line()}")
    for round_ in range(num_iters):
        progress(f"timed run {round_ + 1}/{num_iters}: "
                 f"{', '.join(strategies)}, {steps} steps each ...")
        for name, runner in runners.items():
            run = generate(model, batch, prompts, steps, step=runner,
                           keep_logits=round_ == 0, prefill=prefills[name])
            timings[name].runs.append(run.step_seconds)
            timings[name].prefills.append(run.prefill_seconds)
            if round_ == 0:
                timings[name].correctness = check_routed_against_no_cache(
                    model, batch, prompts, run, dtype, prefills[name], runner)
        if after_round is not None:
            after_round()
    if breakdown_steps:
        progress("breaking a few steps of each strategy down (where the time goes) ...")
    device = batch.kv_cache.device.type
    for name, runner in runners.items():
        if breakdown_steps:
            batch.start(model, prompts, prefills[name])
            weight_bytes = streamed_weight_bytes(model, None if name == "eager"
                                                 else model.matmul_dtype)
            timings[name].breakdown = break_down_steps(lambda r=runner: batch.step(r),
                                                       min(breakdown_steps, steps), device, name,
                                                       weight_bytes)
        runner.discard()
    shared.discard()
    graphs.clear()
    return timings


def streamed_weight_bytes(model: Decoder, matmul_dtype: torch.dtype | None) -> int:
    """Bytes the weight matmuls of one step read: every linear weight once, in the dtype the
    products run in (None: the weights' own; float32 where compiled code upcasts them)."""
    dtype = matmul_dtype or next(model.parameters()).dtype
    return model.arch.linear_weights() * torch.empty((), dtype=dtype).element_size()


EAGER_SUMMED = "eager_summed"  # the eager step with the attention summed as compiled code does


def time_eager_summed(model: Decoder, batch: PagedBatch, prompts: list[torch.Tensor],
                      steps: int, timing: StrategyTiming, dtype: str) -> None:
    """One more timed run, appended to `timing`: the eager step with the paged attention
    summed (`summed_attention`), as every compiled strategy runs it; its first run is checked
    against the reference, its routing recorded by a rerun that sums as the run did (or it may
    cross a near-tie the run did not). Called after each round of `time_strategies`."""
    first = not timing.runs
    with summed_attention():
        run = generate(model, batch, prompts, steps, keep_logits=first)
        if first:
            timing.correctness = check_routed_against_no_cache(model, batch, prompts, run,
                                                               dtype)
    timing.runs.append(run.step_seconds)
    timing.prefills.append(run.prefill_seconds)


# --- the whole measurement --------------------------------------------------------------------

@dataclass
class DecodeReport:
    """Everything one decode benchmark measured."""

    settings: Settings
    layout: KVCacheLayout
    fit: CacheFit
    limits: DeviceLimits
    mixed_lens: list[int]
    mixed: Correctness
    timings: dict[str, StrategyTiming]
    costs: list[StepCost]               # per decode step of the timed runs
    dtype_speed: DtypeSpeed | None      # the run's 16-bit matmuls against float32's, here
    eager_summed: StrategyTiming | None  # the eager step with compiled code's attention form
    machine: dict = field(default_factory=dict)
    load_average: dict = field(default_factory=dict)
    weights_bytes: int = 0              # the built model's parameters, counted tensor by tensor

    @property
    def floor_seconds(self) -> list[float]:
        return [c.floor_seconds(self.limits.bandwidth) for c in self.costs]

    @property
    def median_cost(self) -> StepCost:
        return self.costs[len(self.costs) // 2]

    @property
    def median_floor_seconds(self) -> float:
        """The bandwidth floor of the median step (as each strategy's, `StrategyTiming`)."""
        return statistics.median(self.floor_seconds)

    @property
    def compute_floor_seconds(self) -> float:
        """The median step's FLOPs at the fastest matmul throughput measured here
        (`compute_rate`)."""
        return self.median_cost.flops / self.compute_rate

    @property
    def compute_rate(self) -> float:
        """FLOP/s of the run's dtype, or float32's where that is faster: where 16-bit products
        are emulated, compiled code multiplies the 16-bit weights in float32."""
        rate = self.limits.matmul_flops_per_second
        if self.dtype_speed is not None:
            rate = max(rate, self.dtype_speed.float32_flops_per_second)
        return rate

    def form_and_compiler(self) -> dict | None:
        """The eager step with two matmuls ÷ with summed products (what the attention's form
        buys), and with summed products ÷ the best compiled strategy (what the compiler buys,
        the form being the same); None without an eager and a compiled strategy."""
        compiled = [t for n, t in self.timings.items() if n != "eager"]
        if "eager" not in self.timings or not compiled or not self.eager_summed:
            return None
        best = min(compiled, key=lambda t: t.median)
        eager, summed = self.timings["eager"].median, self.eager_summed.median
        return {"eager_matmuls_seconds": Seconds(eager), "eager_summed_seconds": Seconds(summed),
                "best_compiled": best.strategy, "best_compiled_seconds": Seconds(best.median),
                "form_buys": Ratio(eager / summed), "compiler_buys": Ratio(summed / best.median)}

    def hardware(self) -> dict:
        """The copy and the matmuls measured here (float32's too in a 16-bit run), as every
        run's machine section gathers them."""
        rates = {self.limits.matmul_dtype: self.limits.matmul_flops_per_second}
        if self.dtype_speed is not None:
            rates["float32"] = self.dtype_speed.float32_flops_per_second
        return hardware_figures(self.limits.bandwidth, rates)

    def machine_warning(self) -> str | None:
        """Why no timing of this run is to be trusted (a busy machine), or None."""
        return load_warning(self.load_average, self.machine.get("torch_threads") or 1)

    def timing_warnings(self) -> dict[str, str]:
        """What says a median here is not to be trusted: the machine's load, and each
        strategy's own spread (`kit.measure.timing`), by name; empty when nothing does."""
        found = {"the machine": self.machine_warning(),
                 **{n: spread_warning(t.samples.seconds) for n, t in self.timings.items()}}
        return {n: why for n, why in found.items() if why}

    def verdict(self) -> str:
        """The chapter's word on its step timings (`kit.measure.timing.verdict_line`)."""
        return verdict_line(self.timing_warnings())

    def best(self) -> StrategyTiming:
        return min(self.timings.values(), key=lambda t: t.median)

    def failed_correctness(self) -> list[str]:
        """Runs whose logits left the no-cache reference's tolerance (strategies, and "mixed
        lengths" for the eager run of mixed prompt lengths)."""
        runs = [*self.timings.values(), *([self.eager_summed] if self.eager_summed else [])]
        failed = [t.strategy for t in runs if not t.correctness.ok]
        return failed + ([] if self.mixed.ok else ["mixed lengths"])

    def summary(self) -> dict:
        s = self.settings
        return {"settings": s.as_dict(), "model": s.arch.name, "device": s.device,
                **Count.of({"batch_size": s.batch_size, "input_len": s.input_len,
                            "output_len": s.output_len}),
                "cache_fit": self.fit.summary(), "limits": self.limits.summary(),
                "median_step_cost": self.median_cost.summary(),
                "experts_read_per_step": [Count.of(list(c.experts_read)) for c in self.costs],
                "floor_seconds": Seconds.of(self.floor_seconds),
                "compute_floor_seconds": Seconds.of(self.compute_floor_seconds),
                "compute_rate": FlopPerSecond(self.compute_rate),
                "mixed_lengths": {"prompt_lens": Count.of(self.mixed_lens), **self.mixed.summary()},
                "strategies": {k: t.summary() for k, t in self.timings.items()},
                "dtype_speed": self.dtype_speed.summary() if self.dtype_speed else None,
                "eager_summed": self.eager_summed.summary() if self.eager_summed else None,
                "form_and_compiler": self.form_and_compiler(),
                "best_strategy": self.best().strategy, "hardware": self.hardware(),
                "machine": self.machine,
                "load_average": Number.of(self.load_average),
                "timing_warnings": self.timing_warnings()}


def run_decode(settings: Settings, layout: KVCacheLayout, progress=print,
               recorded: dict | None = None) -> DecodeReport:
    """The chapter's measurement in the run's KV cache (`layout`): correctness, then every
    strategy timed against the floor. `recorded`: chapter 01's record in this run folder,
    whose eager profile sizes the budget when it was measured with the same settings."""
    early_fit(settings, layout)
    strategies = settings.strategies_to_run()
    load_before = os.getloadavg()
    progress(f"building {settings.arch.name} ({settings.dtype}) on {settings.device} ...")
    # CUDA memory before the model exists: a budget profiled now tells non-torch memory apart
    before = cuda_usage() if settings.device == "cuda" else None
    model = build_model(settings.arch, settings.dtype, settings.device, settings.seed)
    fit = fit_in_cache(settings, layout, *decode_budget(settings, model, recorded, before))
    progress(f"KV cache: the run needs {fit.blocks_needed:,} of the {fit.budget_blocks:,} "
             f"blocks the budget holds ({fit.budget_source}); allocating those it needs")
    kv_cache = allocate(layout, fit.blocks_needed, settings.device)
    progress("measuring copy bandwidth and matmul throughput (about a second each) ...")
    limits = measure_limits(settings.device, settings.dtype)
    speed = beside_float32(settings.device, settings.dtype, limits.matmul_flops_per_second)
    progress(f"  {limits.bandwidth / 1e9:,.1f} GB/s copy, "
             f"{fmt_flops(limits.matmul_flops_per_second)} {settings.dtype} matmul"
             + (f" ({speed.slowdown:,.1f}× slower than float32)" if speed and speed.slow else ""))
    mixed_lens, mixed = check_mixed_lengths(settings, layout, model, kv_cache)
    progress(f"mixed prompt lengths {mixed_lens}: max logit error {mixed.max_error:.1e} "
             f"(tolerance {mixed.tolerance:.0e} for {settings.dtype})")
    batch, prompts = decode_inputs(settings, layout, kv_cache)
    picks = None
    if moe_layers(model):  # what each step really reads: the experts its tokens picked
        picks, _ = record_picks(model, batch, prompts, fit.steps)
        progress(f"experts picked per step and MoE layer (eager pass): {picks.counts()}")
    costs = step_costs(settings, layout, fit, picks.counts() if picks else None)
    samples = []  # the copy again after each round of timed runs
    summed = StrategyTiming(EAGER_SUMMED, len(prompts))

    def after_round():
        time_eager_summed(model, batch, prompts, fit.steps, summed, settings.dtype)
        samples.append(copy_bandwidth(settings.device, RESAMPLE_SECONDS).rate)
    timings = time_strategies(model, batch, prompts, fit.steps, strategies, settings.dtype,
                              settings.num_iters, progress, after_round=after_round)
    limits = limits.with_samples(samples)
    for t in timings.values():
        t.floor_seconds = [c.floor_seconds(limits.bandwidth) for c in costs]
        progress(f"{t.strategy}: median step {t.median * 1e3:.2f} ms (p10 {t.p10 * 1e3:.2f}, "
                 f"p90 {t.p90 * 1e3:.2f}), floor ÷ step {t.percent_of_floor:.0f}%")
    return DecodeReport(settings, layout, fit, limits, mixed_lens, mixed, timings, costs, speed,
                        summed, machine={**describe(settings.device), "versions": versions()},
                        load_average={"before": load_before, "after": os.getloadavg()},
                        weights_bytes=weights_bytes(model))


def step_costs(settings: Settings, layout: KVCacheLayout, fit: CacheFit,
               experts_read: list | None = None) -> list[StepCost]:
    """What each decode step of the run must move and compute (its context grows a token a
    step; an MoE step reads the experts recorded for it, `experts_read[t]` per MoE layer)."""
    return [decode_step_cost(settings.arch, settings.dtype_bytes, layout.specs,
                             [n + t + 1 for n in fit.prompt_lens],
                             experts_read[t] if experts_read else None)
            for t in range(fit.steps)]


def check_mixed_lengths(settings: Settings, layout: KVCacheLayout, model: Decoder,
                        kv_cache: torch.Tensor) -> tuple[list[int], Correctness]:
    """An eager run of prompts of different lengths in one batch against the reference (they
    are no longer than input_len, so they fit in the cache the timed runs use)."""
    batch, prompts = decode_inputs(settings, layout, kv_cache, mixed=True, seed_offset=1)
    run = generate(model, batch, prompts, settings.output_len - 1)
    return batch.lengths, check_routed_against_no_cache(model, batch, prompts, run,
                                                        settings.dtype)


def vllm_cpu_reference(settings: Settings) -> dict | None:
    """vLLM CPU's recorded step times, only where they were measured on this kind of machine
    (`cpu_kind`: the CPU, the kernels PyTorch and oneDNN pick) for this model, dtype, batch and
    input length; else None, and chapter 05 measures vLLM live beside the kit."""
    recorded = reference("vllm_cpu")
    if settings.device != "cpu" or recorded["machine"] != cpu_kind():
        return None
    return next((r for r in recorded["runs"] if r["model"] == settings.arch.name
                 and r["dtype"] == settings.dtype and r["batch_size"] == settings.batch_size
                 and r["input_len"] == settings.input_len), None)


def steps_versus_pr(timings: dict[str, StrategyTiming]) -> dict:
    """Stock compile (guards checked on every call) over guard-free, per step and end to end,
    beside the PR's before ÷ after; empty unless both strategies ran."""
    if "stock" not in timings or "guard_free" not in timings:
        return {}
    pr, stock, free = reference("pr7796"), timings["stock"], timings["guard_free"]
    return Ratio.of({
        "step_stock_over_guard_free": stock.median / free.median,
        "e2e_stock_over_guard_free": stock.end_to_end_seconds / free.end_to_end_seconds,
        "pr_step_ratio": pr["decode_step_ms_before"] / pr["decode_step_ms_after"],
        "pr_e2e_ratio": pr["e2e_latency_s_before"] / pr["e2e_latency_s_after"]})
