"""Chapter 06's figures and tables: a logged run's budget as a waterfall, what one request
reserves in each of vLLM's groups, the log's numbers beside the kit's, and the what-if rows.
Drawn from plain values handed in (`kit.studies.your_vllm` makes them)."""
from __future__ import annotations

import plotly.graph_objects as go

from kit.show.tables import Table


def budget_waterfall(parts: list[tuple[str, float | None]]) -> go.Figure:
    """capacity × utilization, then each part taken off, ending at the KV cache (GiB; parts
    the log does not state are left out)."""
    known = [(label, v) for label, v in parts if v is not None]
    total_first = known and known[0][0].startswith("capacity")
    measures = [("absolute" if i == 0 and total_first else "total" if label == "KV cache"
                 else "relative") for i, (label, _) in enumerate(known)]
    values = [v if m != "relative" else -v for (_, v), m in zip(known, measures)]
    fig = go.Figure(go.Waterfall(x=[label for label, _ in known], y=values, measure=measures,
                                 text=[f"{v:.2f}" for _, v in known], textposition="outside"))
    fig.update_layout(title="The budget as the log states it (GiB)", yaxis_title="GiB",
                      showlegend=False, height=380)
    return fig


def groups_bars(rows: list[dict]) -> go.Figure:
    """The tokens one max_model_len request reserves in each group, by kind."""
    labels = [f"{i}: {r['kind']} ({r['layers']} layers)" for i, r in enumerate(rows)]
    fig = go.Figure(go.Bar(x=labels, y=[r["tokens per request"] for r in rows],
                           text=[f"{r['blocks per request']} blocks" for r in rows]))
    fig.update_layout(title="What one request of max_model_len reserves in each group",
                      yaxis_title="tokens", height=360)
    return fig


def numbers_table(numbers: list[dict]) -> Table:
    """The log's numbers beside the kit's."""
    mark = {True: "agrees", False: "differs", None: "from the log"}
    return Table([{"number": n["what"], "log": n["logged"], "kit": n.get("kit") or "",
                   "": mark[n["agrees"]], "how, or why not": n.get("why") or n["how"]}
                  for n in numbers], "The log's numbers, computed again")


def what_if_table(rows: list[dict]) -> Table:
    """What each change would give, at the log's KV cache memory."""
    return Table([{"change": r["change"], "max_model_len": f"{r['max_model_len']:,}",
                   "tokens": f"{r['tokens']:,}" if r["tokens"] else "",
                   "max concurrency": f"{r['max_concurrency']:.2f}x" if r["max_concurrency"]
                   else "refused", "reaches the target": {True: "yes", False: "no",
                                                          None: ""}[r["reaches"]],
                   "note": r["note"]} for r in rows], "What if")
