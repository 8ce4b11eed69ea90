"""The tables of a mixture of experts: chapter 01's weights with every expert resident and its
profiling forward routed through the experts beside the dense model of the same active size;
chapter 04's step against batch size and what routing does to a compiled layer."""
from __future__ import annotations

from kit.show.judgement import marked, marked_title
from kit.show.tables import Table, fmt_bytes


def weights_split_table(rows: list[dict]) -> Table:
    """Chapter 01's weights with every expert resident (`memory_profiling.weights_split`)."""
    return Table([{"model": r["model"], "parameters": f"{r['parameters']:,}",
                   "active per token": f"{r['active_parameters']:,} ({r['active_share']:.1%})",
                   "weights": fmt_bytes(r["weights_bytes"]),
                   "of which experts": f"{fmt_bytes(r['experts_bytes'])} "
                                       f"({r['experts_share']:.1%})"} for r in rows])


def experts_profiles_table(summary: dict) -> Table:
    """One layer of each model at the largest batch (`memory_profiling.experts_summary`)."""
    return Table([{"one layer of": name, "tokens": f"{r['num_tokens']:,}",
                   "weights": fmt_bytes(r["layer_weights_bytes"]),
                   "peak activations, eager": fmt_bytes(r["eager_peak_activation_bytes"]),
                   "compiled": fmt_bytes(r["compiled_peak_activation_bytes"]),
                   "the MLP's least (floor)": fmt_bytes(r["mlp_floor_bytes"])}
                  for name, r in summary.items()])


def experts_by_batch_table(curves, machine: str | None = None) -> Table:
    """Chapter 04: per batch size, each model's median eager step and floor, and the MoE's
    distinct experts per layer measured beside E·(1 − (1 − k/E)^B)
    (`kit.studies.experts_by_batch.BatchCurve`)."""
    rows, warned = [], {k: v for c in curves for k, v in c.timing_warnings().items()}
    for i, b in enumerate(curves[0].batch_sizes):
        row = {"batch": b}
        for c in curves:
            row[f"{c.label} step / floor (ms)"] = marked(
                f"{c.medians[i] * 1e3:.2f} / {c.floor_medians[i] * 1e3:.2f}",
                warned.get(f"{c.label}, batch {b}") or machine)
            if c.is_moe:
                row[f"{c.label} experts per layer: measured / expected"] = \
                    f"{c.measured_distinct[i]:.2f} / {c.expected_distinct[i]:.2f}"
        rows.append(row)
    return Table(rows, marked_title("", warned or ({"the machine": machine} if machine else {})))


def routing_compile_table(results) -> Table:
    """Chapter 04: what routing does to a compiled MoE layer
    (`kit.studies.experts_by_batch.RoutingCompile`)."""
    return Table([{"form": r.form, "routings": r.routings, "fullgraph=True": r.fullgraph,
                   "graphs": r.graphs, "graph breaks": r.graph_breaks,
                   "recompiles": r.recompiles} for r in results])
