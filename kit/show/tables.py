"""Tables for the chapters: a small `Table` that shows as HTML in JupyterLab and as text in
logs, byte sizes in human units, and the rows each chapter shows of its results."""
from __future__ import annotations

import html

from kit.show.judgement import FLOOR_SHARE, marked, marked_title, unsteady
from kit.units import Bytes, MiB, fmt_bytes, fmt_bytes_exact, fmt_flops


# The column beside the measured numbers: the pull request the kit is built around.
PR_COLUMN = "vLLM #7796 (Gemma-2B, GPU)"


class Table:
    """A small table that shows as HTML in JupyterLab and as text in logs."""

    def __init__(self, rows: list[dict], title: str = ""):
        self.rows, self.title = rows, title
        self.columns = list(dict.fromkeys(k for r in rows for k in r))

    def _cells(self, row):
        return [str(row.get(c, "")) for c in self.columns]

    def __repr__(self):
        widths = [max([len(c)] + [len(self._cells(r)[i]) for r in self.rows])
                  for i, c in enumerate(self.columns)]
        lines = [self.title] if self.title else []
        lines.append("  ".join(c.ljust(w) for c, w in zip(self.columns, widths)))
        lines += ["  ".join(v.ljust(w) for v, w in zip(self._cells(r), widths)) for r in self.rows]
        return "\n".join(lines)

    def _repr_html_(self):
        head = "".join(f"<th>{c}</th>" for c in self.columns)
        body = "".join("<tr>" + "".join(f"<td>{v}</td>" for v in self._cells(r)) + "</tr>"
                       for r in self.rows)
        caption = f"<caption>{self.title}</caption>" if self.title else ""
        return f"<table>{caption}<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def model_table(settings, *names: str) -> Table:
    """The model's shape and the run's dtype and device, then the settings `names` (sizes in
    bytes shown in KiB, MiB or GiB)."""
    a = settings.arch
    row = {"model": a.name, "family": a.family, "layers": a.num_hidden_layers,
           "hidden": a.hidden_size,
           "heads / KV heads": f"{a.num_attention_heads} / {a.num_key_value_heads}",
           "head_dim": a.head_dim, "parameters": parameters_cell(a),
           "dtype": settings.dtype, "device": settings.device}
    values = settings.as_dict()  # typed: sizes are `Bytes`
    row.update({n: fmt_bytes(values[n]) if isinstance(values[n], Bytes) else values[n]
                for n in names})
    return Table([row])


def parameters_cell(arch) -> str:
    """The parameter count; for a mixture of experts, every expert's (resident) and those one
    token runs (`ModelConfig.active_parameters`)."""
    total = f"{arch.num_parameters():,}"
    if not arch.num_experts:
        return total
    return (f"{total} ({arch.active_parameters():,} active: {arch.num_experts_per_tok} of "
            f"{arch.num_experts} experts)")


# --- chapter 00 -------------------------------------------------------------------------------

class Verdict:
    """Chapter 00's verdict (`kit.studies.setup_check.Readiness`): a coloured box in
    JupyterLab, its text in logs."""

    def __init__(self, readiness):
        self.readiness = readiness

    def __repr__(self):
        return repr(self.readiness)

    def _repr_html_(self):
        r = self.readiness
        colour, text = ("#1a7f37", "#dafbe1") if r.ready else ("#cf222e", "#ffebe9")
        items = "".join(f"<li><b>{html.escape(n)}</b>: {html.escape(f)}</li>" for n, f in r.todo)
        head = html.escape(repr(r).splitlines()[0])
        return (f'<div class="kit-readiness" style="background:{text};color:{colour};'
                f'padding:12px 16px;border-radius:6px;font-size:1.2em"><b>{head}</b>'
                f'{"<ul style=color:#1d2329>" + items + "</ul>" if items else ""}</div>')


def machine_table(machine: dict, versions: dict) -> Table:
    """The machine and the software, one row per field (the ISA has its own table)."""
    fields = {k: v for k, v in {**machine, **versions}.items() if k != "cpu_isa"}
    return Table([{"what": k, "value": fmt_bytes_exact(v) if isinstance(v, Bytes) else v}
                  for k, v in fields.items()])


def isa_table(isa: dict) -> Table:
    """The CPU's vector ISA (`kit.measure.device.cpu_isa`): what PyTorch's kernels use, what
    the CPU advertises, any cap on oneDNN."""
    def shown(v):
        return "yes" if v is True else "no" if v is False else "not capped" if v is None else v
    return Table([{"": k, "value": shown(v)} for k, v in isa.items()])


def compilers_table(compilers) -> Table:
    """Chapter 00's compilers (`kit.studies.setup_check.Compiler` each): which one, or what
    to install."""
    return Table([{"language": c.language, "used by": c.used_by,
                   "command": c.command if c.found else "none found",
                   "version, or what to do": c.version if c.found else c.install}
                  for c in compilers])


def probes_table(p) -> Table:
    """Chapter 00's probes (`kit.studies.setup_check.Probes`)."""
    rows = [{"probe": "memory measurement",
             "result": p.seen_error or f"{fmt_bytes(p.seen_bytes)} seen of "
                                       f"{fmt_bytes(p.probe_bytes)}"},
            {"probe": "torch.compile",
             "result": p.compile_error or f"compiled and matched eager in "
                                          f"{p.compile_seconds:.1f} s"}]
    return Table(rows + [throughput_row(t) for t in (p.copy, *p.matmuls.values())])


def throughput_row(t) -> dict:
    """One bounded probe (`kit.measure.throughput.Throughput`): its size, median, spread, rate."""
    if t.what == "copy":
        probe, rate = f"copy of {fmt_bytes(t.size)}", f"{t.rate / 1e9:,.1f} GB/s"
    else:
        probe, rate = f"{t.size}×{t.size} {t.dtype} matmul", f"{t.rate / 1e9:,.1f} GFLOP/s"
    return {"probe": probe,
            "result": f"{rate}: {t.timings.median * 1e3:,.2f} ms median of "
                      f"{len(t.timings.seconds)} (p10–p90 {t.timings.spread * 1e3:,.2f} ms), "
                      f"{t.seconds:.1f} s in all"}


# --- chapter 01 -------------------------------------------------------------------------------

def profiles_table(profiles: dict) -> Table:
    """Chapter 01's profiles (`MemoryProfile` each) side by side."""
    return Table([{"": name, "tokens × seqs": f"{p.num_tokens} in {p.num_seqs}",
                   "weights": fmt_bytes(p.weights_bytes),
                   "peak activations": fmt_bytes(p.peak_activation_bytes),
                   "non-torch": fmt_bytes(p.non_torch_bytes),
                   "capacity": fmt_bytes(p.capacity_bytes), "budget": fmt_bytes(p.budget_bytes),
                   "left for KV cache": fmt_bytes(p.kv_cache_bytes)}
                  for name, p in profiles.items()])


def memory_pr_table(v) -> Table:
    """Chapter 01's ratios (`kit.studies.memory_profiling.VersusPR`) beside the PR's."""
    compiled, eager = v.pr_blocks
    return Table([{"quantity": "KV cache, compiled profile ÷ eager profile",
                   "measured here": f"{v.kv_ratio:.4f}",
                   PR_COLUMN: f"{v.pr_kv_ratio:.4f} ({compiled} / {eager} blocks)"},
                  {"quantity": "the eager profile's extra activations ÷ the KV cache it leaves",
                   "measured here": f"{fmt_bytes(v.extra_bytes)} ÷ "
                                    f"{fmt_bytes(v.eager_kv_bytes)} = {v.extra_over_eager_kv:.3f}",
                   PR_COLUMN: f"{compiled - eager} ÷ {eager} blocks = "
                              f"{v.pr_extra_over_eager_kv:.3f}"},
                  {"quantity": "peak activations, compiled ÷ eager",
                   "measured here": f"{v.activation_ratio:.3f}",
                   PR_COLUMN: "not published"},
                  {"quantity": "weights ÷ the device's capacity",
                   "measured here": f"{v.weights_share:.1%}",
                   PR_COLUMN: f"{v.pr_weights_share:.1%} (bf16 weights on the "
                              "16 GiB GPU its numbers fit)"}])


# --- chapter 03 -------------------------------------------------------------------------------

def plans_table(comparison) -> Table:
    """Chapter 03's plans as a learner reads them: units, and why a plan did not run. A plan
    that captured CUDA graphs adds a column: its warm-up runs and captures, apart from its
    compile."""
    def us(x):
        return "–" if x is None else f"{x * 1e6:,.0f}"  # –: not measured for this plan
    captured = any(r.capture_seconds for r in comparison.results.values())
    rows = []
    for r in comparison.results.values():
        if not r.available:  # every measured column says so, the note says why
            rows.append({"#": r.number, "plan": r.name, "serves with": r.serve,
                         "profiles with": r.profile_with, "compile s (profile / serve)":
                         "not run here", "note": r.reason})
            continue
        rows.append({
            "#": r.number, "plan": r.name, "serves with": r.serve,
            "profiles with": r.profile_with + (", discarded" if r.discard else ""),
            "compile s (profile / serve)": f"{r.profile_compile_seconds or 0:.1f} / "
                                           f"{r.compile_seconds:.1f}",
            **({"CUDA graph capture s": f"{r.capture_seconds:.1f}"} if captured else {}),
            "cache entries": r.cache_entries,
            "guards": "–" if r.guards_total is None else r.guards_total,
            "graphs": r.graphs_compiled, "recompiles": r.recompiles,
            "µs/forward": us(r.forward_seconds), "µs direct": us(r.direct_seconds),
            "Dynamo µs/call": us(r.dynamo_overhead_seconds),
            "cache lookup µs (profiler)": us(r.cache_lookup_seconds),
            "peak activations MiB": f"{r.peak_activation_bytes / MiB:,.2f}",
            "KV blocks": f"{r.num_blocks:,}",
            "max |diff| / max |eager|": "n/a (trace failed)" if r.max_rel_diff is None
            else f"{r.max_rel_diff:.2g} (≤ {r.tolerance:g})",
            "note": r.recompile_error or ""})
    columns = list(dict.fromkeys(k for row in rows for k in row))
    rows = [{c: row.get(c, "–") for c in columns} for row in rows]  # a plan not run: dashes
    s = comparison.settings
    return Table(rows, title=f"{s.arch.name}, {s.dtype}, {s.device}")


def overhead_table(comparison, target: float) -> Table:
    """Dynamo's cost per call at decode shape, per plan, against the `target` fraction."""
    return Table([{"plan": r.name, "Dynamo µs per call": f"{r.dynamo_overhead_seconds * 1e6:,.1f}",
                   "as a share of the graph's time": f"{r.overhead_fraction:.1%}",
                   "from the quickest calls alone": f"{r.overhead_best_fraction:.1%}",
                   f"within {target:.0%}?": "yes" if r.overhead_fraction <= target else "no"}
                  for r in comparison.results.values() if r.overhead_fraction is not None],
                 title="Dynamo's cost per call at decode shape (a benchmark target, noisy on a "
                       "shared machine)")


def mlp_probe_table(probe: dict, published_us: dict) -> Table:
    """The tiny-MLP probe's per-call times beside the published ones."""
    return Table([{"tiny MLP": name, "µs per call here": f"{p['seconds'] * 1e6:.1f}",
                   "quickest call": f"{p['best_seconds'] * 1e6:.1f}",
                   "µs above the graph called directly": f"{p['over_direct_seconds'] * 1e6:.1f}",
                   "issue's one noisy run": published_us.get(name, "")}
                  for name, p in probe.items()])


def compile_pr_table(comparison, ratios: dict, pr: dict) -> Table:
    """Chapter 03's ratios (`plans_versus_pr`) and Dynamo figures beside the PR's."""
    r = comparison.results
    p3, p4, stock, free = (r["profile_eager"], r["profile_compiled_discard"], r["stock"],
                           r["guard_free"])
    return Table([
        {"quantity": "KV blocks, compiled profile ÷ eager profile (4 ÷ 3)",
         PR_COLUMN: f"{ratios['pr_blocks_ratio']:.3f} "
                    f"({pr['kv_blocks_profile_compiled']} / "
                    f"{pr['kv_blocks_profile_eager']})",
         "measured here": f"{ratios['measured_blocks_ratio']:.4f} "
                          f"({p4.num_blocks:,} / {p3.num_blocks:,})"},
        {"quantity": "decode step, profiling compile discarded ÷ kept (4 ÷ 2)",
         PR_COLUMN: f"{ratios['pr_step_ratio']:.3f} "
                    f"({pr['decode_step_ms_after']} / "
                    f"{pr['decode_step_ms_before']} ms)",
         "measured here": f"{ratios['measured_step_ratio']:.3f} "
                          f"({p4.forward_seconds * 1e3:.2f} / "
                          f"{stock.forward_seconds * 1e3:.2f} ms)"},
        {"quantity": "Dynamo overhead per step",
         PR_COLUMN: f"{pr['dynamo_overhead_ms_low']}–"
                    f"{pr['dynamo_overhead_ms_high']} ms saved",
         "measured here": f"stock {stock.dynamo_overhead_seconds * 1e3:.3f} ms, "
                          f"guard-free {free.dynamo_overhead_seconds * 1e3:.3f} ms"},
        {"quantity": "guards on the served code",
         PR_COLUMN: str(pr["served_guards"]),
         "measured here": f"{p4.guards_total} (stock compile, {p4.cache_entries} entries), "
                          f"{free.guards_total} guard-free"}])


# --- chapter 04 -------------------------------------------------------------------------------

def matmul_cell(breakdown, step_seconds: float) -> str:
    """The weight matmuls' share of a profiled step and the rate they stream weights at in a
    step of `step_seconds` (the timed median)."""
    if breakdown is None or breakdown.gemm_bandwidth is None:
        return "n/a"
    share = breakdown.shares()["weight matmuls"]
    return f"{share:.0%}, {breakdown.gemm_bandwidth_at(step_seconds) / 1e9:,.1f}"


def bandwidth_line(limits) -> str:
    """The copy bandwidth samples of a run (`DeviceLimits`) in one line."""
    samples = limits.bandwidth_samples
    return (f"median {limits.bandwidth / 1e9:,.1f} GB/s of {len(samples)} measurements "
            f"({min(samples) / 1e9:,.1f}–{max(samples) / 1e9:,.1f})")


def decode_table(report) -> Table:
    """Chapter 04's strategies (`DecodeReport`): step times, floor, correctness, matmuls; the
    CUDA graph capture apart from the compile when a strategy captured one."""
    captured = any(t.capture_seconds for t in report.timings.values())
    warned = report.timing_warnings()
    rows = [{"strategy": t.strategy, "compile s": f"{t.compile_seconds:.2f}"
             + (f" (graph: {t.reused_from}'s)" if t.reused_from else ""),
             **({"capture s": f"{t.capture_seconds:.2f}"} if captured else {}),
             "graphs / guards": f"{t.graphs_compiled} / {t.guards}",
             "median ms": marked(f"{t.median * 1e3:.2f}", unsteady(warned, t.strategy)),
             "p10–p90 ms": f"{t.p10 * 1e3:.2f}–{t.p90 * 1e3:.2f}",
             "prefill s": f"{t.prefill_seconds:.3f} ({t.prefill})",
             "end to end s": f"{t.end_to_end_seconds:.3f}",
             "tokens/s": f"{t.tokens_per_second:,.0f}",
             FLOOR_SHARE: floor_cell(t),
             "max logit error": f"{t.correctness.max_error:.1e}",
             "weight matmuls: share, GB/s": matmul_cell(t.breakdown, t.median)}
            for t in report.timings.values()]
    s = report.settings
    return Table(rows, marked_title(f"{s.arch.name}, batch {s.batch_size}, input "
                                    f"{s.input_len}, {report.fit.steps} decode steps, "
                                    f"{s.dtype}, {s.device}", warned))



def correctness_table(report) -> Table:
    """Every run of chapter 04 against the no-cache reference."""
    m = report.mixed
    rows = [{"run": f"mixed lengths {report.mixed_lens} (eager)", "max error": f"{m.max_error:.1e}",
             "tolerance": f"{m.tolerance:.0e}", "same greedy token": f"{m.token_agreement:.0%}"}]
    rows += [{"run": name, "max error": f"{t.correctness.max_error:.1e}",
              "tolerance": f"{t.correctness.tolerance:.0e}",
              "same greedy token": f"{t.correctness.token_agreement:.0%}"}
             for name, t in report.timings.items()]
    return Table(rows, "Paged decode against the no-cache reference, every step")


def end_to_end_table(report, pr: dict, vllm: dict | None) -> Table:
    """Warm-up, prefill, step and end to end per strategy, the PR's (and vLLM CPU's recorded
    figures for this shape, when there are any) beside."""
    warned = report.timing_warnings()
    rows = [{"strategy": n, "warm-up s (compile included)": f"{t.warmup_seconds:.2f}",
             "prefill ms": f"{t.prefill_seconds * 1e3:.1f}",
             "median step ms": marked(f"{t.median * 1e3:.2f}", unsteady(warned, n)),
             "prefill s": f"{t.prefill_seconds:.3f} ({t.prefill})",
             "end to end s": f"{t.end_to_end_seconds:.3f}",
             "tokens/s": f"{t.tokens_per_second:,.0f}"}
            for n, t in report.timings.items()]
    rows.append({"strategy": "vLLM #7796 (Gemma-2B, GPU): before → after",
                 "median step ms":
                     f"{pr['decode_step_ms_before']} → {pr['decode_step_ms_after']}",
                 "end to end s":
                     f"{pr['e2e_latency_s_before']} → {pr['e2e_latency_s_after']}"})
    if vllm:
        rows.append({"strategy": "vLLM CPU 0.32, this machine, dtype and shape (recorded): "
                                 "eager / compiled",
                     "median step ms": f"{vllm['step_ms_eager']} / {vllm['step_ms_compiled']}"})
    elif report.settings.device == "cpu":
        rows.append({"strategy": "vLLM CPU: no figure recorded for this machine, dtype and "
                                 "shape; chapter 05 runs vLLM beside the kit"})
    return Table(rows, marked_title("", warned))


def floor_cell(t) -> str:
    """A strategy's floor ÷ median step, flagged when the step beat its floor."""
    return f"{t.percent_of_floor:.0f}%" + (" (faster than its floor: repeat the measurement)"
                                           if t.faster_than_floor else "")


def roofline_table(report) -> Table:
    """Each strategy's median step against the bandwidth floor of the median step."""
    cost, warned = report.median_cost, report.timing_warnings()
    return Table([{"strategy": n,
                   "median step ms": marked(f"{t.median * 1e3:.2f}", unsteady(warned, n)),
                   "floor ms": f"{t.median_floor_seconds * 1e3:.2f}",
                   FLOOR_SHARE: floor_cell(t),
                   "achieved GB/s": f"{cost.total_bytes / t.median / 1e9:,.1f}",
                   "achieved": fmt_flops(cost.flops / t.median)}
                  for n, t in report.timings.items()], marked_title("", warned))


def step_parts_table(report) -> Table:
    """Each strategy's median step split by its profile, with the rate the weight matmuls
    stream the weights at beside the copy bandwidth."""
    warned = report.timing_warnings()

    def row(name, t):
        bw = t.breakdown.gemm_bandwidth_at(t.median)
        return {"strategy": name,
                "median step ms": marked(f"{t.median * 1e3:.2f}", unsteady(warned, name)),
                **{f"{part} ms": f"{seconds * 1e3:.2f}"
                   for part, seconds in t.breakdown.scaled(t.median).items()},
                "weight matmuls GB/s": f"{bw / 1e9:,.1f}" if bw else "n/a (not seen)",
                "copy GB/s": f"{report.limits.bandwidth / 1e9:,.1f}"}
    steps = next(iter(report.timings.values())).breakdown.steps
    return Table([row(n, t) for n, t in report.timings.items()], marked_title(
        f"Each strategy's median step, split by a profile of {steps} more steps", warned))


# --- chapter 05 -------------------------------------------------------------------------------

def engines_table(runs: dict) -> Table:
    """The started vLLM engines (`EngineRun` per mode): compilation, start-up, KV log line,
    threads and decode steps."""
    return Table([{"mode": mode,
                   "compilation": f"{r.compilation_mode} / "
                                  f"{r.compile_backend if mode == 'compiled' else '-'}",
                   "start-up (s)": f"{r.startup_seconds:.1f}",
                   "compile (s)": f"{r.compile_seconds or 0:.1f}",
                   "KV log line": r.kv_log_line, "threads": r.torch_threads,
                   "step median (ms)": f"{r.decode_step_median * 1e3:.3f}",
                   "step p90 - p10 (ms)": f"{r.decode_step_spread * 1e3:.3f}"}
                  for mode, r in runs.items()])


def token_table(comparisons: dict, left_out: dict | None = None) -> Table:
    """Chapter 05's token comparison per dtype (`TokenComparison` each), then the dtypes left
    out, each with why (`token_for_token.token_dtypes`)."""
    rows = []
    for dtype, c in comparisons.items():
        if c.error:
            rows.append({"dtype": dtype, "tokens agreeing": "not compared", "check": c.error})
            continue
        parted = [s for s in c.steps if s.kit_logprob is not None]
        worst = max(abs(s.kit_logprob - s.vllm_logprob) for s in parted)
        lows = {q: c.first_low_margin(q) for q in sorted({s.seq for s in c.steps})}
        rows.append({"dtype": dtype, "tokens agreeing": f"{c.agreement:.0%} of {len(c.steps)}",
                     "tokens that must agree": c.checked,
                     "largest log-prob difference": f"{worst:.1e}",
                     "first step under the margin tolerance, per sequence":
                         ", ".join(f"{q}: {'none' if t is None else t}" for q, t in lows.items()),
                     "check": "pass" if c.ok else "FAIL"})
    rows += [{"dtype": d, "tokens agreeing": "not compared", "check": why}
             for d, why in (left_out or {}).items()]
    return Table(rows)


def held_blocks_table(curves) -> Table:
    """Blocks each variant's batch held after its last step at each context length
    (`kit.studies.step_vs_context.ContextCurve.held`)."""
    return Table([{"context (tokens per sequence)": f"{n:,}",
                   **{f"blocks held: {c.label}": f"{c.held[i]:,}" for c in curves}}
                  for i, n in enumerate(curves[0].lengths)])


def form_table(report) -> Table | str:
    """Chapter 04: what the attention's form buys and what the compiler buys
    (`DecodeReport.form_and_compiler`)."""
    f = report.form_and_compiler()
    if f is None:
        return "needs the eager strategy and a compiled one"
    return Table([{"eager, two matmuls (ms)": f"{f['eager_matmuls_seconds'] * 1e3:.2f}",
                   "eager, summed products (ms)": f"{f['eager_summed_seconds'] * 1e3:.2f}",
                   f"{f['best_compiled']}, summed products (ms)":
                       f"{f['best_compiled_seconds'] * 1e3:.2f}",
                   "the form buys (matmuls ÷ summed, eager)": f"{f['form_buys']:.2f}×",
                   "the compiler buys (eager ÷ compiled, summed)": f"{f['compiler_buys']:.2f}×"}])
