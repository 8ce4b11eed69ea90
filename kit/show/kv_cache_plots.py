"""Chapter 02's figures (plotly): how memory splits and what the KV cache buys (the
calculator), the KV cache groups, max concurrency against max_model_len, which sequence owns
each block, and one sequence's block tables step by step. Each takes what a study returned
and draws it; none measures anything."""
from __future__ import annotations

import plotly.graph_objects as go

from kit.show.plots import COLORS
from kit.units import GiB


def kv_calculator(calc, title: str = "") -> go.Figure:
    """Left: how the device's memory splits. Right: requests of each length that fit
    (`kv_cache_sizing.Calculation`)."""
    from plotly.subplots import make_subplots
    s, budget = calc.config, calc.budget
    fig = make_subplots(rows=1, cols=2, column_widths=[0.35, 0.65], subplot_titles=(
        "memory of one device", "requests that fit (max concurrency)"))
    kv = budget.kv_cache_bytes
    parts = {"weights": budget.weights_bytes, "activations": budget.activation_bytes,
             "KV cache": s.cache_bytes, "unused": budget.reserved_bytes
             + (kv - s.cache_bytes if kv > 0 else 0)}
    for part, value in parts.items():
        fig.add_bar(name=part, x=["device"], y=[value / GiB], marker_color=COLORS[part],
                    row=1, col=1, hovertemplate="%{y:,.3f} GiB<extra>" + part + "</extra>")
    lengths = [2**k for k in range(8, 18)]
    fig.add_scatter(x=lengths, y=[s.concurrency_at(n) for n in lengths],
                    mode="lines+markers", name="concurrency", line_color=COLORS["KV cache"],
                    row=1, col=2, showlegend=False)
    fig.add_scatter(x=[s.max_model_len], y=[s.max_concurrency], mode="markers", name="max_model_len",
                    marker=dict(size=14, color=COLORS["short"]), row=1, col=2)
    # label the powers of two drawn, and decades of requests, not plotly's 2-5 minor labels
    fig.update_xaxes(type="log", title_text="tokens per request", row=1, col=2, tickvals=lengths,
                     ticktext=[f"{n // 1024}k" if n >= 1024 else str(n) for n in lengths])
    fig.update_yaxes(type="log", title_text="requests", row=1, col=2, dtick=1)
    fig.update_yaxes(title_text="GiB", row=1, col=1)
    fig.update_layout(barmode="stack", title=title or (
        f"{s.num_blocks:,} blocks of {s.layout.block_size} tokens · {s.num_tokens:,} tokens · "
        f"{s.max_concurrency:.2f}× concurrency at max_model_len {s.max_model_len:,}"))
    return fig


def kv_groups(config) -> go.Figure:
    """Layers (columns) by KV cache group (rows): which group each layer's cache belongs to,
    its attention kind, and the blocks a max_model_len request reserves in each group
    (`KVCacheConfig`)."""
    layout, groups = config.layout, config.layout.groups
    z, text = [], []
    for g in groups:
        z.append([(1 if g.window is None else 0) if i in g.layers else None
                  for i in range(layout.num_layers)])
        text.append([f"layer {i}: {g.spec.describe()}" for i in range(layout.num_layers)])
    need = [g.blocks_per_request(config.max_model_len, config.in_flight_tokens) for g in groups]
    rows = [f"group {k}: {n:,} blocks" for k, n in enumerate(need)]
    fig = go.Figure(go.Heatmap(z=z, x=list(range(layout.num_layers)), y=rows, text=text, zmin=0,
                               zmax=1, colorscale=[[0, COLORS["short"]], [1, COLORS["KV cache"]]],
                               showscale=False, xgap=2, ygap=2,
                               hovertemplate="%{text}<br>%{y} per request<extra></extra>"))
    fig.update_layout(
        title=f"{len(groups)} KV cache group(s) of at most {layout.group_size} layers · a block "
              f"id costs {layout.group_size} × {layout.page_size_bytes:,} B<br><sup>a request of "
              f"{config.max_model_len:,} tokens reserves {config.blocks_per_request:,} blocks "
              "in all · green: full attention, red: sliding window</sup>",
        xaxis_title="layer", yaxis_autorange="reversed", height=160 + 28 * len(groups))
    return fig


def concurrency_vs_len(curves: list[tuple[str, list, list, str]], title: str,
                       points: list[tuple[str, list, list, str]] = ()) -> go.Figure:
    """Max concurrency against max_model_len, one line per (label, lengths, values, dash);
    None where the cache would be refused. `points`: the same as open markers in each line's
    colour (vLLM's numbers beside the kit's lines)."""
    fig = go.Figure()
    palette = ["#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b2", "#937860"]
    for (label, lengths, values, dash), color in zip(curves, palette):
        fig.add_scatter(x=lengths, y=values, name=label, mode="lines+markers", line_dash=dash,
                        line_color=color)
    for (label, lengths, values, _), color in zip(points, palette):
        fig.add_scatter(x=lengths, y=values, name=label, mode="markers", marker=dict(
            color=color, size=13, symbol="circle-open", line_width=2))
    fig.update_xaxes(type="log", title_text="max_model_len (tokens per request)",
                     tickvals=curves[0][1], ticktext=[f"{n // 1024}k" if n >= 1024 else str(n)
                                                      for n in curves[0][1]])
    fig.update_yaxes(type="log", title_text="max concurrency (requests)")
    fig.update_layout(title=title)
    return fig


def block_ownership(tables, max_blocks: int = 256) -> go.Figure:
    """Which sequence owns each of the first blocks of the cache, in any group's table
    (`GroupedBlockTables`; free blocks and the null block, block 0, blank)."""
    owner = [None] * min(tables.num_blocks, max_blocks)
    for seq, per_group in tables.tables.items():
        for block in (b for table in per_group for b in table if b):
            if block < len(owner):
                owner[block] = seq
    width = 32
    rows = [owner[i:i + width] for i in range(0, len(owner), width)]
    # free blocks stay None: blank cells, so the owned ones stand out
    fig = go.Figure(go.Heatmap(z=rows, colorscale="Viridis", zmin=0, showscale=False, xgap=1, ygap=1,
                               hovertemplate="block %{customdata}: seq %{z}<extra></extra>",
                               customdata=[[i * width + j for j in range(len(r))]
                                           for i, r in enumerate(rows)]))
    shown = len(owner)
    which = (f"all {shown:,} blocks" if shown == tables.num_blocks else
             f"the first {shown:,} of the cache's {tables.num_blocks:,} blocks")
    fig.update_layout(title=f"Block ownership: {which} (colour: sequence; blank: free)",
                      xaxis_title="block % 32", yaxis_title="block // 32",
                      yaxis_autorange="reversed")
    return fig


TABLE_ENTRY = {0: ("handed back (null block)", "#e8e8e8"),
               1: ("handed back this step", "#c44e52"),
               2: ("held", "#55a868"),
               3: ("taken this step", "#4c72b0")}


def _entry_kind(i: int, table: tuple, num_freed: int, num_new: int) -> int:
    nulls = table.count(0)  # vLLM's null block is block 0; a window nulls a prefix
    if i < nulls:
        return 1 if i >= nulls - num_freed else 0
    return 3 if i >= len(table) - num_new else 2


def _table_cells(result, group: int) -> tuple[list, list]:
    """z (entry kinds) and hover text, table entry by step, for one group."""
    width = max(len(s.tables[group]) for s in result.steps)
    z = [[None] * len(result.steps) for _ in range(width)]
    text = [[""] * len(result.steps) for _ in range(width)]
    for x, s in enumerate(result.steps):
        table, freed, new = s.tables[group], s.freed[group], s.new[group]
        nulls = table.count(0)
        for i, block in enumerate(table):
            z[i][x] = _entry_kind(i, table, len(freed), len(new))
            text[i][x] = (f"block {block}" if block else
                          f"null block (handed back block {freed[nulls - 1 - i]})"
                          if z[i][x] == 1 else "null block")
    return z, text


def group_tables_steps(result) -> go.Figure:
    """One sequence's block table in each KV cache group, decode step by step (`TableSteps`):
    held blocks, blocks taken and handed back at each step, null-block entries; above, the
    pool's free blocks."""
    from plotly.subplots import make_subplots
    n = len(result.groups)
    fig = make_subplots(rows=n + 1, cols=1, shared_xaxes=True, vertical_spacing=0.02,
                        row_heights=[1.5] + [1] * n,
                        subplot_titles=["free blocks in the pool"])
    steps = [s.step for s in result.steps]
    fig.add_scatter(x=steps, y=[s.num_free_blocks for s in result.steps], mode="lines+markers",
                    line_shape="hv", showlegend=False, row=1, col=1)
    scale = [[k / 4 + e, TABLE_ENTRY[k][1]] for k in range(4) for e in (0, 0.25)]
    for g in range(n):
        z, text = _table_cells(result, g)
        fig.add_heatmap(z=z, x=steps, text=text, zmin=-0.5, zmax=3.5, colorscale=scale,
                        showscale=False, xgap=1, ygap=1, row=g + 2, col=1,
                        hovertemplate="step %{x}, entry %{y}: %{text}<extra>"
                        + result.groups[g].describe() + "</extra>")
        window = result.groups[g].window
        fig.update_yaxes(title_text=f"group {g}<br>" + ("full" if window is None
                                                       else f"window {window:,}"),
                         autorange="reversed", row=g + 2, col=1)
    for kind, (label, colour) in TABLE_ENTRY.items():  # a legend for the cell colours
        fig.add_scatter(x=[None], y=[None], mode="markers", name=label,
                        marker=dict(color=colour, size=10, symbol="square"), row=1, col=1)
    fig.update_xaxes(title_text="step (0: prefill)", row=n + 1, col=1)
    fig.update_layout(height=220 + 140 * n, title=(
        f"{result.model}: one sequence's block table per KV cache group (entries down, "
        f"steps across), blocks of {result.blocks}"))
    return fig


def latent_bytes(rows: list[dict]) -> go.Figure:
    """Bytes one token keeps in one layer: latent attention's latent against the keys and
    values multi-head attention would keep for the same heads (`cache_kinds_lesson`)."""
    fig = go.Figure()
    names = [r["model"] for r in rows]
    for key, label, color in (("mha_bytes_per_token_layer", "multi-head K and V", COLORS["short"]),
                              ("latent_bytes_per_token_layer", "latent", COLORS["KV cache"])):
        fig.add_bar(name=label, x=names, y=[r[key] for r in rows], marker_color=color,
                    text=[f"{r[key]:,} B" for r in rows], textposition="outside")
    fig.update_yaxes(type="log", range=[2, 5.3], title_text="bytes per token per layer (bf16)")
    fig.update_layout(barmode="group", title="What one token keeps in one layer: a latent "
                      "(kv_lora_rank + qk_rope_head_dim) against K and V per head")
    return fig


def hybrid_pages(hybrids) -> go.Figure:
    """Each hybrid's recurrent state and the padding that makes it one attention page, with
    the attention block vLLM sets for it (`cache_kinds_lesson.HybridBlock`)."""
    fig = go.Figure()
    names = [f"{h.model}<br>{h.device}" for h in hybrids]
    states = [h.state.state_bytes / 2**20 for h in hybrids]
    padding = [(h.state.page_size_bytes - h.state.state_bytes) / 2**20 for h in hybrids]
    fig.add_bar(name="recurrent state", x=names, y=states, marker_color=COLORS["KV cache"])
    fig.add_bar(name="padding to the attention page", x=names, y=padding,
                marker_color=COLORS["short"],
                text=[f"block {h.layout.block_size:,}<br>+{h.padding:.2%}" for h in hybrids],
                textposition="outside", textfont_size=13)
    fig.update_yaxes(title_text="MiB per layer per request")
    fig.update_layout(barmode="stack", title="A hybrid's page holds one state: the attention "
                      "block vLLM sets, and what the padding adds")
    return fig
