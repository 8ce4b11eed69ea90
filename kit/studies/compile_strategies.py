"""Chapter 03, compile strategies side by side: what each way of running the model costs and
buys, measured on one model, one set of inputs and one set of settings.

Each row of the chapter is a *plan*: how the profiling run is executed (by which strategy, and
whether that compilation is thrown away afterwards) and by which strategy the model is then
served (a `kit.engine.runners` runner). For each plan `compare` measures: compile time (for
CUDA graphs, the warm-up runs and captures apart: `capture_seconds`), guards and cache entries
on the served code, graphs compiled and recompiles over a realistic sequence of decode batch
sizes, the per-call cost of Dynamo (through Dynamo versus the same compiled graph called
directly, and the profiler's "TorchDynamo Cache Lookup"), the profile's peak memory and the KV
cache blocks it leaves (chapters 01 and 02), the time of one forward at decode shape, and the
largest difference of the outputs from eager.

    python -m kit bench compile [--preset NAME] [-p NAME=VALUE ...]   # the table as JSON
"""
from __future__ import annotations

import gc
from dataclasses import asdict, dataclass, field

import torch

from kit.config import TOLERANCE, Settings, reference
from kit.engine.budget import requested_memory
from kit.engine.kv_cache import KVCacheLayout, config_for_settings
from kit.engine.profile_run import check_fits, no_kv_cache_message, profile_batch, profile_run
from kit.engine.model import build_model, weights_bytes
from kit.engine.runners import capture_sizes_up_to, make_runner
from kit.engine.serving_trace import decode_batch_sizes
from kit.errors import ConfigError
from kit.units import Bytes, Count, Fraction, Number, Ratio, Seconds, typed
from kit.measure.device import capacity_bytes
from kit.measure.memory import cuda_usage
from kit.measure.timing import (cache_lookup_seconds, interleaved_timings, paired_difference,
                                per_round_best)


@dataclass(frozen=True)
class Plan:
    """How a row of the chapter profiles and serves: `profile_with` is the strategy that runs
    the profiling forward ("eager" or a compiled one), `serve` the one that serves; when they
    are equal, serving reuses the same runner, hence the same code and Dynamo cache, as an
    engine does."""

    number: int  # the numbering
    name: str
    serve: str
    profile_with: str
    discard: bool  # throw away the profiling compilation before serving
    summary: str


PLANS = (
    Plan(1, "eager", "eager", "eager", False, "no compilation at all"),
    Plan(2, "stock", "stock", "stock", False,
         "torch.compile, batch dimension dynamic, guards evaluated on every call; the profiling "
         "run is compiled and its compilation stays in the cache (vLLM before #7796)"),
    Plan(3, "profile_eager", "stock", "eager", False,
         "the PR's first version: profile eager, serve compiled"),
    Plan(4, "profile_compiled_discard", "stock", "stock", True,
         "the PR's final version: compile the profiling run, measure, discard, compile again"),
    Plan(5, "guard_free", "guard_free", "guard_free", True,
         "guards dropped (guard_filter_fn) + set_stance('fail_on_recompile'), as vLLM serves "
         "today; the profiling compilation discarded (it would otherwise serve every shape)"),
    Plan(6, "bytecode_hook", "bytecode_hook", "bytecode_hook", True,
         "calls run Dynamo's transformed bytecode directly (vLLM's bytecode-hook dispatcher)"),
    Plan(7, "cuda_graphs", "cuda_graphs", "guard_free", True,
         "GPU only: one CUDA graph per decode batch size over the guard-free compiled model"),
)
PLAN_NAMES = tuple(p.name for p in PLANS)


def get_plans(names=None) -> list[Plan]:
    if names is None:
        return list(PLANS)
    unknown = [n for n in names if n not in PLAN_NAMES]
    if unknown:
        raise ConfigError(f"unknown plan {unknown}: use some of {list(PLAN_NAMES)}")
    return [p for p in PLANS if p.name in names]


@dataclass
class PlanResult:
    """What one plan measured. Times in seconds, memory in bytes; None: not applicable."""

    number: int
    name: str
    serve: str
    profile_with: str
    discard: bool
    summary: str
    available: bool = True
    reason: str = ""  # why not, when unavailable
    profile_compile_seconds: float | None = None
    compile_seconds: float | None = None  # the first serving call
    capture_seconds: float | None = None  # CUDA graphs' warm-up runs and captures (else 0)
    peak_activation_bytes: int | None = None
    non_torch_bytes: int | None = None  # measured on CUDA only
    kv_cache_bytes: int | None = None
    num_blocks: int | None = None
    cache_entries: int | None = None
    guards: list[int] = field(default_factory=list)  # per cache entry of the served code
    graphs_compiled: int | None = None  # by the serving runner, profiling included when shared
    recompiles: int | None = None  # during the decode step sequence
    recompile_error: str | None = None
    # per-call times: the median over rounds of each round's quickest call (per_round_best)
    forward_seconds: float | None = None  # one forward at decode shape
    forward_spread: float | None = None  # p90 - p10 of those over rounds
    forward_best_seconds: float | None = None  # the quickest call of all
    direct_seconds: float | None = None  # the same compiled graph called directly
    direct_best_seconds: float | None = None
    dynamo_overhead_seconds: float | None = None  # paired_difference(through, direct)
    dynamo_overhead_best_seconds: float | None = None  # quickest through - quickest direct
    cache_lookup_seconds: float | None = None
    max_abs_diff: float | None = None
    max_rel_diff: float | None = None  # max |diff| / max |eager|
    tolerance: float | None = None

    @property
    def guards_total(self) -> int | None:
        return sum(self.guards) if self.available and self.serve != "eager" else None

    @property
    def overhead_fraction(self) -> float | None:
        """Dynamo's per-call cost as a share of the graph's own time (median estimate)."""
        if self.dynamo_overhead_seconds is None or not self.direct_seconds:
            return None
        return self.dynamo_overhead_seconds / self.direct_seconds

    @property
    def overhead_best_fraction(self) -> float | None:
        if self.dynamo_overhead_best_seconds is None or not self.direct_best_seconds:
            return None
        return self.dynamo_overhead_best_seconds / self.direct_best_seconds

    @property
    def matches_eager(self) -> bool | None:
        return None if self.max_rel_diff is None else self.max_rel_diff <= self.tolerance

    def row(self) -> dict:
        """The table row (JSON-ready), its numbers typed."""
        out = asdict(self)
        out.update(guards_total=self.guards_total, overhead_fraction=self.overhead_fraction,
                   overhead_best_fraction=self.overhead_best_fraction,
                   matches_eager=self.matches_eager)
        return typed(out, PLAN_QUANTITIES)


PLAN_QUANTITIES = {
    Seconds: ("profile_compile_seconds", "compile_seconds", "capture_seconds", "forward_seconds",
              "forward_spread", "forward_best_seconds", "direct_seconds", "direct_best_seconds",
              "dynamo_overhead_seconds", "dynamo_overhead_best_seconds", "cache_lookup_seconds"),
    Bytes: ("peak_activation_bytes", "non_torch_bytes", "kv_cache_bytes"),
    Count: ("number", "num_blocks", "cache_entries", "guards", "graphs_compiled", "recompiles",
            "guards_total"),
    Number: ("max_abs_diff", "max_rel_diff", "tolerance"),
    Fraction: ("overhead_fraction", "overhead_best_fraction")}


@dataclass
class Comparison:
    """Every plan's result, plus what they were measured on."""

    settings: Settings
    results: dict[str, PlanResult]
    decode_batch_size: int
    step_batch_sizes: list[int]
    bytes_per_block: int
    weights_bytes: int
    budget_bytes: int
    timing_rounds: int
    timing_calls: int

    def rows(self) -> list[dict]:
        return [r.row() for r in self.results.values()]

    def as_dict(self) -> dict:
        return {"preset": self.settings.preset, "device": self.settings.device,
                "model": self.settings.model, "dtype": self.settings.dtype,
                **Count.of({"decode_batch_size": self.decode_batch_size,
                            "step_batch_sizes": self.step_batch_sizes,
                            "timing_rounds": self.timing_rounds,
                            "timing_calls": self.timing_calls}),
                **Bytes.of({"bytes_per_block": self.bytes_per_block,
                            "weights_bytes": self.weights_bytes,
                            "budget_bytes": self.budget_bytes}), "torch": torch.__version__,
                "plans": self.rows()}


def timing_warnings(comparison: Comparison, threads: int) -> dict[str, str]:
    """What the chapter does not trust among its per-call times, by plan: the machine, when
    its load says other work shared the CPU, and each plan whose rounds' quickest calls spread
    (p10 to p90) wider than 1.5 medians (`kit.measure.timing`)."""
    from kit.measure.timing import NOISY_SPREAD, steps_warnings
    found = steps_warnings({}, threads)
    for r in comparison.results.values():
        if r.forward_seconds and (r.forward_spread or 0) > NOISY_SPREAD * r.forward_seconds:
            found[r.name] = (f"p10–p90 of the rounds' quickest calls {r.forward_spread * 1e6:,.0f}"
                             f" µs wide around a {r.forward_seconds * 1e6:,.0f} µs median")
    return found


class _Bench:
    """The shared state of one comparison: model, inputs, eager references."""

    def __init__(self, settings: Settings, layout: KVCacheLayout, step_sizes: list[int]):
        self.settings, self.layout, self.device = settings, layout, settings.device
        # CUDA memory before the model exists, so profiles can tell non-torch memory apart
        self.before = cuda_usage() if self.device == "cuda" else None
        self.model = build_model(settings.arch, settings.dtype, self.device, settings.seed)
        self.weights = weights_bytes(self.model)
        gen = torch.Generator().manual_seed(settings.seed)
        sizes = sorted(set(step_sizes) | {settings.batch_size})
        # one fixed [batch, 1] input per batch size, the same for every plan
        self.inputs = {b: torch.randint(0, settings.arch.vocab_size, (b, 1), generator=gen)
                       .to(self.device) for b in sizes}
        self.reference = {b: self.model(ids) for b, ids in self.inputs.items()}

    def decode_args(self, batch: int) -> tuple:
        return (self.inputs[batch],)


def _profile(bench: _Bench, plan: Plan, res: PlanResult):
    """The profiling run of `plan`; returns the runner that ran it when serving reuses it."""
    s = bench.settings
    runner = None
    if plan.profile_with != "eager":
        runner = make_runner(bench.model.forward, plan.profile_with, bench.device,
                             (profile_batch(s),))
        res.profile_compile_seconds = runner.compile_seconds
    prof = profile_run(bench.model, s, plan.name, bench.weights, bench.before, runner)
    if runner is not None and plan.discard:
        runner.discard()
    res.peak_activation_bytes = prof.peak_activation_bytes
    res.non_torch_bytes = prof.non_torch_bytes
    res.kv_cache_bytes = prof.kv_cache_bytes
    if prof.kv_cache_bytes <= 0:
        raise ConfigError(no_kv_cache_message(prof))
    res.num_blocks = config_for_settings(bench.layout, s, prof.kv_cache_bytes).num_blocks
    return runner if plan.profile_with == plan.serve else None


def _serve(bench: _Bench, plan: Plan, res: PlanResult, runner, step_sizes: list[int]):
    """Warm the serving runner at decode shape, run the step sequence, compare with eager."""
    args = bench.decode_args(bench.settings.batch_size)
    if runner is None:
        runner = make_runner(bench.model.forward, plan.serve, bench.device, args,
                             capture_sizes=capture_sizes_up_to(bench.settings.max_num_seqs))
    else:
        runner.warm(args)
    res.compile_seconds, res.capture_seconds = runner.compile_seconds, runner.capture_seconds
    before = runner.graphs_compiled
    worst, scale = 0.0, 0.0
    try:
        for b in step_sizes:
            out = runner(*bench.decode_args(b)).float()
            ref = bench.reference[b].float()
            worst = max(worst, (out - ref).abs().max().item())
            scale = max(scale, ref.abs().max().item())
        res.max_abs_diff, res.max_rel_diff = worst, worst / scale if scale else 0.0
    except Exception as e:  # guard_free's fail_on_recompile lands here: that is the result
        res.recompile_error = f"{type(e).__name__}: {str(e).splitlines()[0]}"
    res.graphs_compiled = runner.graphs_compiled
    res.recompiles = runner.graphs_compiled - before
    res.tolerance = TOLERANCE[bench.settings.dtype]
    res.cache_entries = len(runner.cache_entries())
    res.guards = runner.guards()
    return runner


def run_plan(bench: _Bench, plan: Plan, step_sizes: list[int]):
    """Profile, then serve; returns (result, runner or None when unavailable)."""
    res = PlanResult(plan.number, plan.name, plan.serve, plan.profile_with, plan.discard,
                     plan.summary)
    try:
        if plan.serve == "cuda_graphs" and bench.device != "cuda":
            raise ConfigError("CUDA graphs need a GPU (device='cuda'); this run is on "
                              f"{bench.device}")
        runner = _profile(bench, plan, res)
        runner = _serve(bench, plan, res, runner, step_sizes)
    except ConfigError as e:  # the plan cannot run here (no GPU, no bytecode hook)
        # an eager profile that left no KV cache: no plan can be compared, so the chapter
        # stops before compiling any (chapters 02 and 04 refuse the same settings)
        if plan.profile_with == "eager" and res.num_blocks is None:
            raise
        res.available, res.reason = False, str(e)
        return res, None
    return res, runner


def _time_all(bench: _Bench, results: dict, runners: dict, rounds: int, calls: int):
    """Forward at decode shape for every runner, and each compiled graph called directly,
    all interleaved; then the profiler's cache-lookup time."""
    args = bench.decode_args(bench.settings.batch_size)
    fns = {name: (lambda r=runner: r(*args)) for name, runner in runners.items()}
    direct = {name: r.direct_call(*args) for name, r in runners.items()
              if hasattr(r, "direct_call")}
    timings = interleaved_timings({**fns, **{f"{n} direct": f for n, f in direct.items()}},
                                  bench.device, rounds, calls)
    for name in runners:
        res, t = results[name], per_round_best(timings[name])
        res.forward_seconds, res.forward_spread = t.median, t.spread
        res.forward_best_seconds = min(t.seconds)
        if name in direct:
            d = per_round_best(timings[f"{name} direct"])
            res.direct_seconds, res.direct_best_seconds = d.median, min(d.seconds)
            res.dynamo_overhead_seconds = paired_difference(timings[name],
                                                            timings[f"{name} direct"])
            res.dynamo_overhead_best_seconds = min(t.seconds) - min(d.seconds)
            res.cache_lookup_seconds = cache_lookup_seconds(fns[name], bench.device)


def _enter_fail_on_recompile():
    with torch.compiler.set_stance("fail_on_recompile"):
        pass


class TinyMLP(torch.nn.Module):
    """Two linear layers: a model so small that Dynamo's per-call cost is a large share."""

    def __init__(self, width: int = 256):
        super().__init__()
        self.up, self.down = torch.nn.Linear(width, width), torch.nn.Linear(width, width)

    def forward(self, x):
        return self.down(torch.nn.functional.gelu(self.up(x)))


def overhead_probe(device: str, batch: int = 8, rounds: int = 30, calls: int = 20) -> dict:
    """Per-call seconds of a tiny MLP run eagerly, compiled stock, guard-free, by bytecode
    hook, its compiled graph called directly, and the `set_stance` context guard_free enters on
    every call (the published figures: `kit.config.reference("mlp_probe")`):
    {name: {"seconds", "best_seconds", "over_direct_seconds"}} (see _time_all)."""
    torch.manual_seed(0)
    mlp = TinyMLP().to(device).eval()
    x = torch.randn(batch, 256, device=device)
    with torch.inference_mode():
        runners = {name: make_runner(mlp.forward, name, device, (x,))
                   for name in ("eager", "stock", "guard_free", "bytecode_hook")}
        fns = {name: (lambda r=r: r(x)) for name, r in runners.items()}
        fns["graph called directly"] = runners["guard_free"].direct_call(x)
        fns["set_stance context alone"] = _enter_fail_on_recompile  # part of guard_free's cost
        timings = interleaved_timings(fns, device, rounds, calls)
    for runner in runners.values():
        runner.discard()
    direct = timings["graph called directly"]
    return {name: Seconds.of({"seconds": per_round_best(t).median,
                              "best_seconds": min(per_round_best(t).seconds),
                              "over_direct_seconds": paired_difference(t, direct)})
            for name, t in timings.items()}


def compare(settings: Settings, layout: KVCacheLayout, plans=None, step_sizes=None,
            rounds: int = 30, calls: int = 10) -> Comparison:
    """Run every plan (or those named) on one model and one set of inputs, each profile's KV
    budget in blocks of the run's cache (`layout`); see the module docstring for what is
    measured. `step_sizes`: the decode batch sizes, one per step
    (default: `decode_batch_sizes(max_num_seqs)`). Timings interleave all plans over
    `rounds` rounds of `calls` calls each."""
    plans = get_plans(plans)
    check_fits(settings)
    step_sizes = list(step_sizes or decode_batch_sizes(settings.max_num_seqs, seed=settings.seed))
    results, runners = {}, {}
    with torch.inference_mode():
        bench = _Bench(settings, layout, step_sizes)
        for plan in plans:
            results[plan.name], runner = run_plan(bench, plan, step_sizes)
            if runner is not None:
                runners[plan.name] = runner
            gc.collect()
        _time_all(bench, results, runners, rounds, calls)
    for runner in runners.values():
        runner.discard()
    budget = requested_memory(capacity_bytes(settings.device, settings.device_memory),
                              settings.gpu_memory_utilization)
    return Comparison(settings, results, settings.batch_size, step_sizes,
                      layout.bytes_per_block, bench.weights, budget, rounds, calls)


OVERHEAD_TARGET = 0.05  # the issue's: guard-free at most 5% above the graph called directly


def overhead_target(comparison: Comparison, plan: str = "guard_free") -> dict:
    """The benchmark's target (not a test: timings here are noisy): `plan` costs at most
    OVERHEAD_TARGET more per call than its compiled graph called directly, at decode shape."""
    res = comparison.results.get(plan)
    if res is None or res.overhead_fraction is None:
        return {"plan": plan, "measured": False}
    return {"plan": plan, **Fraction.of({"target_fraction": OVERHEAD_TARGET,
                                         "median_fraction": res.overhead_fraction,
                                         "best_fraction": res.overhead_best_fraction}),
            "met_median": res.overhead_fraction <= OVERHEAD_TARGET,
            "met_best": res.overhead_best_fraction <= OVERHEAD_TARGET}


def plans_versus_pr(comparison: Comparison) -> dict:
    """The PR's ratios beside the measured ones: KV blocks of the PR's final plan over its
    first (4 ÷ 3), and the decode forward with the profiling compile discarded over kept
    (4 ÷ 2)."""
    pr, r = reference("pr7796"), comparison.results
    p3, p4, stock = r["profile_eager"], r["profile_compiled_discard"], r["stock"]
    return Ratio.of({
        "pr_blocks_ratio": pr["kv_blocks_profile_compiled"] / pr["kv_blocks_profile_eager"],
        "measured_blocks_ratio": p4.num_blocks / p3.num_blocks,
        "pr_step_ratio": pr["decode_step_ms_after"] / pr["decode_step_ms_before"],
        "measured_step_ratio": p4.forward_seconds / stock.forward_seconds})
