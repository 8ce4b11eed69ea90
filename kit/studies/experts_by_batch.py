"""Chapter 04's decode step against batch size, a mixture of experts beside a dense model of the
same active size: the dense step reads every weight whatever the batch, the MoE step reads the
router and the distinct experts its B tokens picked, E·(1 − (1 − k/E)^B) per layer when routing
is uniform (`expected_distinct_experts`), so its bytes, and its floor, grow with the batch.

Each model decodes eagerly at every batch size, in float32 (`DTYPE`): first a recorded pass (`record_picks`: each
step's distinct experts per MoE layer, its logits checked against the no-cache reference),
then a warm-up run and `repeats` timed runs of the same steps (same prompts, greedy, so the same tokens and
routing), the models taking turns. Each step's floor is its bytes (`decode_step_cost` with the
experts recorded for it) over the run's copy bandwidth. `routing_under_dynamo` shows what
routing does to a compiled graph: none of it with the grouped product (`kit::grouped_mm`), a
graph break and a graph per routing when the experts are looped over on the host.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field

import torch

from kit.config import DTYPE_BYTES, ModelConfig, Settings
from kit.engine.decode import batch_for_run, generate, make_prompts
from kit.engine.expert_picks import record_picks
from kit.engine.kv_cache import KVCacheLayout
from kit.engine.layers.experts import expected_distinct_experts, one_moe_layer
from kit.engine.model import build_model
from kit.engine.no_cache import Correctness, check_against_no_cache
from kit.measure.roofline import decode_step_cost
from kit.measure.timing import Timings, spread_warning
from kit.units import Count, Number, Seconds

BATCH_SIZES = (1, 4, 16)  # one token, a few, and past E/k tokens (most experts read)
STEPS = 4       # decode steps per run
PROMPT_LEN = 16
# float32 whatever the run's dtype: in bfloat16 the paged step and the no-cache reference round
# differently, and where two experts' router scores nearly tie one of them picks the other
# expert (seen on tiny-moe: logits 0.03-0.06 apart against 0.008 for tiny), so the check would
# measure that flip rather than the decode; float32 is also fast on every CPU
DTYPE = "float32"


@dataclass
class BatchCurve:
    """One model's eager decode step at each batch size, its floor, and the experts picked."""

    label: str
    arch: ModelConfig
    batch_sizes: list[int]
    steps: dict[int, list[float]] = field(default_factory=dict)   # B -> timed step seconds
    floors: dict[int, list[float]] = field(default_factory=dict)  # B -> each step's floor
    picks: dict[int, list[tuple[int, ...]]] = field(default_factory=dict)  # B -> [step][layer]
    correctness: dict[int, Correctness] = field(default_factory=dict)

    @property
    def is_moe(self) -> bool:
        return self.arch.num_experts > 0

    @property
    def medians(self) -> list[float]:
        return [statistics.median(self.steps[b]) for b in self.batch_sizes]

    def quantiles(self, q: float) -> list[float]:
        """The q-quantile of the steps timed at each batch size (`Timings.quantile`)."""
        return [Timings(self.steps[b]).quantile(q) for b in self.batch_sizes]

    def timing_warnings(self) -> dict[str, str]:
        """Each batch size whose steps spread too wide to trust their median
        (`kit.measure.timing.spread_warning`), by "label, batch B"."""
        found = {f"{self.label}, batch {b}": spread_warning(self.steps[b])
                 for b in self.batch_sizes}
        return {k: v for k, v in found.items() if v}

    @property
    def floor_medians(self) -> list[float]:
        return [statistics.median(self.floors[b]) for b in self.batch_sizes]

    @property
    def measured_distinct(self) -> list[float]:
        """Distinct experts per MoE layer per step, the mean over steps and layers, per B."""
        return [statistics.mean(c for step in self.picks[b] for c in step)
                for b in self.batch_sizes]

    @property
    def expected_distinct(self) -> list[float]:
        a = self.arch
        return [expected_distinct_experts(a.num_experts, a.num_experts_per_tok, b)
                for b in self.batch_sizes]

    def summary(self) -> dict:
        moe = {"measured_distinct": Number.of(self.measured_distinct),
               "expected_distinct": Number.of(self.expected_distinct),
               "picks": {b: [Count.of(list(s)) for s in p] for b, p in self.picks.items()}} \
            if self.is_moe else {}
        return {"label": self.label, "batch_sizes": Count.of(self.batch_sizes),
                **Seconds.of({"median_seconds": self.medians, "floor_seconds": self.floor_medians}),
                "max_error": Number.of([self.correctness[b].max_error for b in self.batch_sizes]),
                **moe}


def step_time_by_batch(settings: Settings, models: tuple[str, ...], bandwidth: float,
                       batch_sizes=BATCH_SIZES, steps: int = STEPS, repeats: int = 2,
                       progress=None) -> list[BatchCurve]:
    """Every model (names under data/models/) decoded eagerly at every batch size, in
    `DTYPE` on the run's device, `PROMPT_LEN`-token prompts; floors at `bandwidth` (bytes/s)."""
    archs = [ModelConfig.load(m) for m in models]
    built = [build_model(a, DTYPE, settings.device, settings.seed) for a in archs]
    curves = [BatchCurve(m, a, list(batch_sizes)) for m, a in zip(models, archs)]
    for b in batch_sizes:
        runs = [prepared_run(settings, c, model, b, steps, bandwidth)
                for c, model in zip(curves, built)]
        for r in range(repeats + 1):  # the first round warms up, not kept
            for curve, model, (batch, prompts) in zip(curves, built, runs):
                run = generate(model, batch, prompts, steps, keep_logits=False)
                if r:
                    curve.steps.setdefault(b, []).extend(run.step_seconds)
        if progress:
            progress(f"batch {b}: " + ", ".join(
                f"{c.label} {statistics.median(c.steps[b]) * 1e3:.2f} ms"
                + (f" ({statistics.mean(n for s in c.picks[b] for n in s):.1f} experts of "
                   f"{c.arch.num_experts} per layer)" if c.is_moe else "") for c in curves))
    return curves


def prepared_run(settings: Settings, curve: BatchCurve, model, b: int, steps: int,
                 bandwidth: float):
    """The recorded, checked pass of `b` sequences (picks, floors, correctness into `curve`);
    returns the batch and prompts the timed runs repeat."""
    arch = curve.arch
    layout = KVCacheLayout.for_model(arch, settings.block_size, DTYPE, device=settings.device)
    lengths = [PROMPT_LEN] * b
    batch = batch_for_run(layout, lengths, steps, settings.device)
    prompts = make_prompts(lengths, arch.vocab_size, settings.seed)
    picks, run = record_picks(model, batch, prompts, steps, keep_logits=True)
    curve.correctness[b] = check_against_no_cache(model, prompts, run, DTYPE)
    counts = picks.counts()
    curve.picks[b] = counts
    curve.floors[b] = [decode_step_cost(arch, DTYPE_BYTES[DTYPE], layout.specs,
                                        [n + t + 1 for n in lengths],
                                        counts[t] or None).floor_seconds(bandwidth)
                       for t in range(steps)]
    return batch, prompts


# --- routing through the compiler -------------------------------------------------------------

@dataclass(frozen=True)
class RoutingCompile:
    """Dynamo on one MoE layer called with inputs that route differently."""

    form: str
    routings: int          # distinct sets of experts among the calls
    fullgraph: str         # "one graph", or why fullgraph=True (the kit's runners') refused it
    graphs: int            # graphs captured over every call
    graph_breaks: int      # in the first call
    recompiles: int        # frames compiled again after the first call

    def summary(self) -> dict:
        return {"form": self.form, "fullgraph": self.fullgraph, **Count.of({
            "routings": self.routings, "graphs": self.graphs,
            "graph_breaks": self.graph_breaks, "recompiles": self.recompiles})}


def host_loop_experts(moe, x: torch.Tensor) -> torch.Tensor:
    """The same experts, looped over on the host: the ids read back (`tolist`) to pick which
    experts run, as a straightforward implementation would."""
    weights, ids = moe.route(x)
    ex, out = moe.experts, torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in ids.unique().tolist():
        token, pick = (ids == e).nonzero(as_tuple=True)
        hidden = ex.act(x[token] @ ex.gate_up_proj[e].T) @ ex.down_proj[e].T
        out.index_add_(0, token, hidden.float() * weights[token, pick, None])
    return out.to(x.dtype)


def dynamo_count(fn, xs, fullgraph: bool) -> tuple[int, int]:
    """(graphs captured over every call of `fn` on `xs`, of them after the first call)."""
    from torch._dynamo.testing import CompileCounter
    torch._dynamo.reset()
    counter = CompileCounter()
    compiled = torch.compile(fn, backend=counter, fullgraph=fullgraph, dynamic=False)
    compiled(xs[0])
    first = counter.frame_count
    for x in xs[1:]:
        compiled(x)
    return counter.frame_count, counter.frame_count - first


@torch.no_grad()
def routing_under_dynamo(arch: ModelConfig, dtype: str, tokens: int = 4, calls: int = 6,
                         seed: int = 0) -> list[RoutingCompile]:
    """One MoE layer of `arch` under Dynamo alone (what decides graph breaks and recompiles;
    no Inductor, so it takes about a second), `calls` inputs of `tokens` tokens: the kit's
    grouped form and the host loop, each with fullgraph=True as the kit's runners compile,
    and where that refuses, without it."""
    moe = one_moe_layer(arch, dtype, seed)
    gen = torch.Generator().manual_seed(seed)
    xs = [torch.randn(tokens, arch.hidden_size, generator=gen).to(moe.gate.weight.dtype)
          for _ in range(calls)]
    routings = len({tuple(moe.route(x)[1].unique().tolist()) for x in xs})
    results = []
    for form, fn in [("grouped (kit::grouped_mm)", lambda x: moe(x)),
                     ("host loop over the picked experts", lambda x: host_loop_experts(moe, x))]:
        try:
            graphs, recompiles = dynamo_count(fn, xs, fullgraph=True)
            results.append(RoutingCompile(form, routings, "one graph", graphs, 0, recompiles))
        except Exception as e:  # noqa: BLE001 -- Dynamo's refusal is the finding
            reason = str(e).strip().splitlines()[0][:120]
            graphs, recompiles = dynamo_count(fn, xs, fullgraph=False)
            torch._dynamo.reset()
            breaks = torch._dynamo.explain(fn)(xs[0]).graph_break_count
            results.append(RoutingCompile(form, routings, f"refused: {reason}", graphs, breaks,
                                          recompiles))
    torch._dynamo.reset()
    return results
