"""Chapter 01's tables of a mixture of experts: its weights with every expert resident, and the
profiling forward routed through its experts beside the dense model of the same active size."""
from __future__ import annotations

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
