"""Figures for the chapters (plotly), so notebooks stay thin. Each takes what a study measured
and draws it; none measures anything."""
from __future__ import annotations

import plotly.colors as pcolors
import plotly.graph_objects as go

from kit.measure.timing import named
from kit.units import MiB

UNSTEADY_COLOR = "#c44e52"

COLORS = {"weights": "#4c72b0", "activations": "#dd8452", "non-torch": "#937860",
          "KV cache": "#55a868", "unused": "#d0d0d0", "short": "#c44e52"}


def memory_breakdown(profiles: dict) -> go.Figure:
    """Stacked bars, one per profile (chapter 01's eager and compiled): where the device's
    memory goes."""
    fig = go.Figure()
    names = list(profiles)
    parts = {
        "weights": [p.weights_bytes for p in profiles.values()],
        "activations": [p.peak_activation_bytes for p in profiles.values()],
        "non-torch": [p.non_torch_bytes or 0 for p in profiles.values()],
        "KV cache": [max(0, p.kv_cache_bytes) for p in profiles.values()],
        "unused": [p.capacity_bytes - p.budget_bytes for p in profiles.values()],
    }
    for part, values in parts.items():
        fig.add_bar(name=part, x=names, y=[v / MiB for v in values], marker_color=COLORS[part],
                    hovertemplate="%{x}: %{y:,.1f} MiB<extra>" + part + "</extra>")
    fig.update_layout(barmode="stack", yaxis_title="MiB", title="Where the device memory goes",
                      legend_traceorder="normal")
    return fig


def activation_bars(profiles: dict) -> go.Figure:
    """Peak activation bytes per profile: the number the KV cache budget depends on."""
    fig = go.Figure(go.Bar(x=list(profiles),
                           y=[p.peak_activation_bytes / MiB for p in profiles.values()],
                           marker_color=COLORS["activations"],
                           text=[f"{p.peak_activation_bytes / MiB:,.1f} MiB"
                                 for p in profiles.values()]))
    fig.update_layout(yaxis_title="MiB", title="Peak activation memory of the profiling run")
    return fig


def memory_timeline(profiles: dict) -> go.Figure:
    """Live bytes above weights + inputs over the profiling forward, one line per profile."""
    fig = go.Figure()
    for name, p in profiles.items():
        fig.add_scatter(x=p.timeline_ms, y=[b / MiB for b in p.timeline_bytes], name=name,
                        mode="lines", line_shape="hv", text=p.timeline_ops,
                        hovertemplate="%{x:.2f} ms: %{y:,.2f} MiB<br>%{text}<extra>"
                        + name + "</extra>")
    fig.update_layout(xaxis_title="time in the forward (ms)",
                      yaxis_title="live activation MiB (above weights + inputs)",
                      title="Memory timeline of the profiling run")
    return fig


def matmul_throughput(matmuls: dict) -> go.Figure:
    """Matmul GFLOP/s per dtype (a log axis: an emulated dtype is tens of times slower)."""
    names = list(matmuls)
    rates = [matmuls[k].rate / 1e9 for k in names]
    fig = go.Figure(go.Bar(x=names, y=rates, text=[f"{r:,.1f}" for r in rates],
                           textposition="outside", marker_color="#4c72b0"))
    fig.update_layout(title="Matmul throughput per dtype, measured here",
                      yaxis={"title": "GFLOP/s", "type": "log"})
    return fig


def judged_figure(fig: go.Figure, warnings: dict | None) -> go.Figure:
    """`fig` with a line under its title naming the timings it draws that are not to be
    trusted (`warnings`: name -> why, `kit.measure.timing`; the chapter prints the whys)."""
    if warnings:
        fig.update_layout(title=f"{fig.layout.title.text}<br><sup style='color:"
                                f"{UNSTEADY_COLOR}'>⚠ not to be trusted: "
                                f"{named(list(warnings))}; close other work and rerun</sup>",
                          margin_t=110)
    return fig


def measured_vs_published(rows: list[tuple[str, float, float]], title: str,
                          warnings: dict | None = None) -> go.Figure:
    """Grouped bars of (label, measured, published) ratios."""
    fig = go.Figure()
    labels = [r[0] for r in rows]
    fig.add_bar(name="measured here", x=labels, y=[r[1] for r in rows])
    fig.add_bar(name="published (seed)", x=labels, y=[r[2] for r in rows])
    fig.update_layout(barmode="group", title=title)
    return judged_figure(fig, warnings)


def versus_pr(ratios: dict, warnings: dict | None = None) -> go.Figure:
    """Stock compile ÷ guard-free, per step and end to end, beside the PR's before ÷ after
    (`kit.studies.decode_timing.steps_versus_pr`)."""
    return measured_vs_published(
        [("step: stock ÷ guard-free", ratios["step_stock_over_guard_free"],
          ratios["pr_step_ratio"]),
         ("end to end: stock ÷ guard-free", ratios["e2e_stock_over_guard_free"],
          ratios["pr_e2e_ratio"])], "Guards cost per step, barely end to end?", warnings)


def step_latency(timings: dict, floor_seconds: list[float], warnings: dict | None = None
                 ) -> go.Figure:
    """Each decode step's time (its median over the timed runs), one line per strategy, with
    the bandwidth floor beneath."""
    fig = go.Figure()
    for name, t in timings.items():
        fig.add_scatter(x=list(range(1, len(t.step_seconds) + 1)),
                        y=[s * 1e3 for s in t.step_seconds], name=name, mode="lines+markers",
                        hovertemplate="step %{x}: %{y:.3f} ms<extra>" + name + "</extra>")
    fig.add_scatter(x=list(range(1, len(floor_seconds) + 1)), y=[s * 1e3 for s in floor_seconds],
                    name="bandwidth floor", mode="lines", line={"dash": "dash", "color": "black"})
    fig.update_layout(xaxis_title="decode step", yaxis_title="ms", yaxis_rangemode="tozero",
                      title="Per-step latency (warm-up and compilation excluded)")
    return judged_figure(fig, warnings)


def step_box(timings: dict, warnings: dict | None = None) -> go.Figure:
    """The spread of step times per strategy: every step of every timed run."""
    fig = go.Figure()
    for name, t in timings.items():
        fig.add_box(y=[s * 1e3 for s in t.samples.seconds], name=name, boxpoints="all")
    fig.update_layout(yaxis_title="ms per decode step", yaxis_rangemode="tozero",
                      title="Step time distribution per strategy", showlegend=False)
    return judged_figure(fig, warnings)


def floor_percent(timings: dict, warnings: dict | None = None) -> go.Figure:
    """Bandwidth floor as % of each strategy's median step, floor ÷ median as the tables show
    them (100% = as fast as a plain copy; a bar over it is flagged as a measurement to
    repeat)."""
    names = list(timings)
    values = [timings[n].percent_of_floor for n in names]
    text = [f"{v:.0f}%" + (" faster than the floor: repeat" if timings[n].faster_than_floor
                           else "") for n, v in zip(names, values)]
    fig = go.Figure(go.Bar(x=names, y=values, text=text, marker_color=COLORS["KV cache"]))
    fig.add_hline(y=100, line_dash="dash", annotation_text="the floor")
    fig.update_layout(yaxis_title="floor ÷ median step (%)",
                      title="How close each strategy gets to the memory-bandwidth limit")
    return judged_figure(fig, warnings)


def step_parts(timings: dict, floor_seconds: float, warnings: dict | None = None) -> go.Figure:
    """Each strategy's median step split into its profiled parts (weight matmuls, sampling,
    everything else), the bandwidth floor of the median step dashed across."""
    fig = go.Figure()
    named = {n: t for n, t in timings.items() if t.breakdown is not None}
    colors = {"weight matmuls": COLORS["weights"], "sampling": COLORS["non-torch"],
              "everything else": COLORS["activations"]}
    parts = {n: t.breakdown.scaled(t.median) for n, t in named.items()}
    for part, color in colors.items():
        fig.add_bar(name=part, x=list(named), y=[parts[n][part] * 1e3 for n in named],
                    marker_color=color, hovertemplate="%{x}: %{y:.2f} ms<extra>" + part + "</extra>")
    fig.add_hline(y=floor_seconds * 1e3, line_dash="dash", annotation_text="bandwidth floor")
    fig.update_layout(barmode="stack", yaxis_title="ms per step (timed median, split by profile)",
                      title="Where a decode step's time goes")
    return judged_figure(fig, warnings)


def plan_bars(rows: list[dict], key: str, title: str, yaxis: str, scale: float = 1.0,
              fmt: str = "{:,.2f}") -> go.Figure:
    """One bar per plan of `row[key] * scale` (chapter 03); plans without the value (not run
    here, or not applicable) are named on the axis with an empty bar."""
    names = [r["name"] for r in rows]
    values = [None if r.get(key) is None else r[key] * scale for r in rows]
    fig = go.Figure(go.Bar(x=names, y=values,
                           text=["n/a" if v is None else fmt.format(v) for v in values]))
    fig.update_layout(title=title, yaxis_title=yaxis)
    return fig


def per_call_bars(rows: list[dict]) -> go.Figure:
    """Per-call time at decode shape through each plan's serving runner, beside the same
    compiled graph called directly (the gap is Dynamo's per-call cost), in µs."""
    rows = [r for r in rows if r.get("forward_seconds") is not None]
    names = [r["name"] for r in rows]
    fig = go.Figure()
    fig.add_bar(name="through the runner", x=names, y=[r["forward_seconds"] * 1e6 for r in rows])
    fig.add_bar(name="compiled graph called directly", x=names,
                y=[None if r["direct_seconds"] is None else r["direct_seconds"] * 1e6
                   for r in rows])
    fig.update_layout(barmode="group", yaxis_title="µs per forward (median)",
                      title="One forward at decode shape")
    return fig


def guard_bars(rows: list[dict]) -> go.Figure:
    """Guards on the served code, stacked by cache entry (newest at the bottom)."""
    rows = [r for r in rows if r.get("guards_total") is not None]
    fig = go.Figure()
    for i in range(max([len(r["guards"]) for r in rows] + [0])):
        fig.add_bar(name=f"cache entry {i + 1}", x=[r["name"] for r in rows],
                    y=[r["guards"][i] if i < len(r["guards"]) else 0 for r in rows])
    fig.update_layout(barmode="stack", yaxis_title="guards",
                      title="Guards Dynamo keeps on the served code, per cache entry")
    return fig


def batch_size_trace(sizes: list[int]) -> go.Figure:
    """The decode batch size of each step of the serving trace."""
    fig = go.Figure(go.Scatter(x=list(range(len(sizes))), y=sizes, mode="lines+markers",
                               line_shape="hv"))
    fig.update_layout(xaxis_title="decode step", yaxis_title="batch size (sequences)",
                      title="Decode batch sizes over the steps of a serving trace")
    return fig


def spread_bars(curve) -> dict:
    """Error bars from each point's p10 to its p90 (`curve.quantiles`, `curve.medians`)."""
    low, high, mid = curve.quantiles(0.1), curve.quantiles(0.9), curve.medians
    return dict(type="data", symmetric=False, array=[(h - m) * 1e3 for h, m in zip(high, mid)],
                arrayminus=[(m - lo) * 1e3 for lo, m in zip(low, mid)])


def step_vs_context(curves, warnings: dict | None = None) -> go.Figure:
    """Median decode step (ms) against context length, one line per variant (`ContextCurve`),
    the p10–p90 of its steps as error bars (on a busy machine the spread, not a jumping line),
    each one's bandwidth floor dotted beneath in its colour."""
    fig = go.Figure()
    palette = ["#4c72b0", "#c44e52", "#55a868", "#8172b2"]
    for curve, color in zip(curves, palette):
        fig.add_scatter(x=curve.lengths, y=[s * 1e3 for s in curve.medians], name=curve.label,
                        mode="lines+markers", line_color=color,
                        error_y=spread_bars(curve))
        fig.add_scatter(x=curve.lengths, y=[s * 1e3 for s in curve.floors], mode="lines",
                        name=f"floor: {curve.label}", line=dict(color=color, dash="dot"))
    fig.update_xaxes(type="log", title_text="context length (tokens per sequence)",
                     tickvals=curves[0].lengths)
    fig.update_yaxes(title_text="median decode step (ms)", rangemode="tozero")
    fig.update_layout(title="Decode step against context: a sliding window stops growing")
    return judged_figure(fig, warnings)


def experts_by_batch(curves, warnings: dict | None = None) -> go.Figure:
    """Left: median eager decode step (ms) against batch size per model (`BatchCurve`), p10 to
    p90 of its steps as error bars, each one's floor dotted beneath (from the experts its steps picked); right: the MoE's distinct
    experts per layer per step, measured beside E·(1 − (1 − k/E)^B)."""
    from plotly.subplots import make_subplots
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.12, subplot_titles=(
        "decode step and its floor", "distinct experts a step reads, per layer"))
    palette = ["#4c72b0", "#c44e52", "#55a868", "#8172b2"]
    for curve, color in zip(curves, palette):
        b = curve.batch_sizes
        fig.add_scatter(x=b, y=[s * 1e3 for s in curve.medians], name=f"step: {curve.label}",
                        mode="lines+markers", line_color=color, row=1, col=1,
                        error_y=spread_bars(curve))
        fig.add_scatter(x=b, y=[s * 1e3 for s in curve.floor_medians], mode="lines",
                        name=f"floor: {curve.label}", line=dict(color=color, dash="dot"),
                        row=1, col=1)
        if curve.is_moe:
            fig.add_scatter(x=b, y=curve.measured_distinct, mode="markers", row=1, col=2,
                            name=f"measured: {curve.label}", marker=dict(color=color, size=9))
            fig.add_scatter(x=b, y=curve.expected_distinct, mode="lines", row=1, col=2,
                            name="E·(1 − (1 − k/E)^B)", line=dict(color=color, dash="dash"))
    for col in (1, 2):
        fig.update_xaxes(type="log", title_text="batch size (sequences)",
                         tickvals=curves[0].batch_sizes, row=1, col=col)
    fig.update_yaxes(title_text="median decode step (ms)", rangemode="tozero", row=1, col=1)
    fig.update_yaxes(title_text="experts per layer", rangemode="tozero", row=1, col=2)
    fig.update_layout(title="An MoE step reads more experts as the batch grows; a dense one "
                            "reads the same weights")
    return judged_figure(fig, warnings)


def kit_vs_vllm(labels: list[str], kit_values: list, vllm_values: list, title: str,
                yaxis_title: str) -> go.Figure:
    """Grouped bars, the kit beside vLLM, one group per label (chapter 05). None: not measured."""
    fig = go.Figure()
    for name, values, color in (("kit", kit_values, "#4c72b0"), ("vLLM", vllm_values, "#dd8452")):
        fig.add_bar(name=name, x=labels, y=values, marker_color=color,
                    text=[f"{v:,.4g}" if v is not None else "n/a" for v in values])
    fig.update_layout(barmode="group", title=title, yaxis_title=yaxis_title)
    return fig


def memory_kit_vs_vllm(kit_profile, vllm_memory: dict) -> go.Figure:
    """Stacked bars (GPU): the kit's profile (`MemoryProfile`) beside the one vLLM computed."""
    parts = {"weights": (kit_profile.weights_bytes, vllm_memory["weights_bytes"]),
             "activations": (kit_profile.peak_activation_bytes,
                             vllm_memory["peak_activation_bytes"]),
             "non-torch": (kit_profile.non_torch_bytes or 0,
                           vllm_memory["non_torch_and_other_bytes"]),
             "KV cache": (max(0, kit_profile.kv_cache_bytes), vllm_memory["kv_cache_budget_bytes"])}
    fig = go.Figure()
    for part, (kit_bytes, vllm_bytes) in parts.items():
        fig.add_bar(name=part, x=["kit", "vLLM"], y=[kit_bytes / MiB, vllm_bytes / MiB],
                    marker_color=COLORS[part])
    fig.update_layout(barmode="stack", yaxis_title="MiB", title="Memory profile: kit and vLLM")
    return fig


def token_logprobs(comparison) -> go.Figure:
    """The kit's against vLLM's log-probability of vLLM's token, step by step, one pair of
    lines per sequence (`kit.studies.token_for_token.TokenComparison`); a cross marks a step
    whose tokens differ."""
    fig = go.Figure()
    palette = pcolors.qualitative.Plotly
    for k, seq in enumerate(sorted({s.seq for s in comparison.steps})):
        steps = [s for s in comparison.steps if s.seq == seq]
        x, colour = [s.step for s in steps], palette[k % len(palette)]  # one colour a sequence
        fig.add_scatter(x=x, y=[s.vllm_logprob for s in steps], mode="lines+markers",
                        name=f"vLLM, seq {seq}", line={"dash": "dot", "color": colour},
                        marker={"color": colour}, legendgroup=f"seq {seq}")
        fig.add_scatter(x=x, y=[s.kit_logprob for s in steps], mode="markers",
                        name=f"kit, seq {seq}", legendgroup=f"seq {seq}", marker={
                            "symbol": ["circle" if s.agree else "x" for s in steps], "size": 8,
                            "color": colour},
                        hovertext=[f"margin {s.margin:.1e}" for s in steps])
        differ = next((s for s in steps if not s.agree), None)
        if differ is not None:  # the kit's dots end here: later steps read other contexts
            fig.add_annotation(x=differ.step, y=differ.vllm_logprob, text=f"seq {seq}: tokens "
                               f"differ at step {differ.step}; not compared after", ax=40, ay=-30,
                               font={"color": colour})
    fig.update_layout(title=f"Log-probability of vLLM's token, {comparison.dtype}",
                      xaxis_title="step (0: the prefill's token)", yaxis_title="log-probability")
    return fig


def sweep_curve(name: str, parameter: str, lines: list[tuple[str, list, list, list]]) -> go.Figure:
    """One recorded number of a sweep against one grid parameter: a line (label, x values,
    y values, point names) per combination of the other parameters' values."""
    fig = go.Figure()
    for label, xs, ys, points in lines:
        fig.add_scatter(x=xs, y=ys, mode="lines+markers", name=label or name, customdata=points,
                        hovertemplate="%{customdata}<br>" + parameter + " = %{x}<br>"
                        + name + " = %{y:,.6g}<extra></extra>")
    xs = {x for _, line_xs, _, _ in lines for x in line_xs}
    numeric = all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in xs)
    fig.update_layout(title=name, xaxis_title=parameter, yaxis_title=name.rsplit(".", 1)[-1],
                      showlegend=len(lines) > 1, height=340, margin=dict(t=50, b=40),
                      xaxis_type=None if numeric else "category")
    if numeric and len(xs) > 1 and all(isinstance(x, int) and x > 0 and x & (x - 1) == 0
                                       for x in xs):  # powers of two: a log-2 axis
        ticks = sorted(xs)
        fig.update_xaxes(type="log", tickvals=ticks, ticktext=[f"{x:,}" for x in ticks])
    return fig


def pr_curve(series: list[tuple[str, list[int], list[int], list[int]]], pr: dict) -> go.Figure:
    """The PR's trade-off as a curve: KV blocks left by the eager and the compiled profile
    against the profiled tokens (top), their ratio (bottom) with the PR's point marked.
    `series`: (label, tokens, eager blocks, compiled blocks) per combination of other values."""
    from plotly.subplots import make_subplots
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.08,
                        row_heights=[0.6, 0.4],
                        subplot_titles=("KV cache blocks left after profiling",
                                        "compiled ÷ eager"))
    for label, tokens, eager, compiled in series:
        prefix = f"{label}: " if label else ""
        for profile, blocks, dash in (("eager", eager, "dot"), ("compiled", compiled, "solid")):
            fig.add_scatter(x=tokens, y=blocks, mode="lines+markers", name=prefix + profile,
                            line_dash=dash, row=1, col=1,
                            hovertemplate="%{x} tokens: %{y:,} blocks<extra>" + prefix + profile
                            + "</extra>")
        ratios = [c / e if e > 0 else None for e, c in zip(eager, compiled)]
        fig.add_scatter(x=tokens, y=ratios, mode="lines+markers", name=prefix + "ratio here",
                        row=2, col=1, hovertemplate="%{x} tokens: %{y:.3f}×<extra></extra>")
    compiled, eager = pr["kv_blocks_profile_compiled"], pr["kv_blocks_profile_eager"]
    fig.add_scatter(x=[pr["max_num_batched_tokens"]], y=[compiled / eager], mode="markers+text",
                    marker=dict(symbol="star", size=16, color="#c44e52"),
                    text=[f"vLLM #7796: {compiled} ÷ {eager} blocks"], textposition="middle left",
                    name="vLLM #7796 (Gemma-2B)", row=2, col=1,
                    hovertemplate="vLLM #7796 at %{x} tokens: %{y:.3f}×<extra></extra>")
    ticks = sorted({t for _, tokens, _, _ in series for t in tokens}
                   | {pr["max_num_batched_tokens"]})
    fig.update_xaxes(type="log", tickvals=ticks, row=1, col=1)
    fig.update_xaxes(type="log", tickvals=ticks, row=2, col=1,
                     title_text="max_num_batched_tokens (profiled tokens)")
    fig.update_yaxes(title_text="blocks", rangemode="tozero", row=1, col=1)
    fig.update_yaxes(title_text="×", row=2, col=1)
    fig.update_layout(title="The PR's curve: what profiling eagerly costs the KV cache",
                      height=620)
    return fig


# each entry of a block table at one step: what the cell's colour says
