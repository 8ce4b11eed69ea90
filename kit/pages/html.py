"""The pieces every page of the kit is built of: its style, escaped cells, tables, values
formatted for people, plotly figures drawn offline (plotly.js travels in the page), the page
itself. Used by the run report, the comparison of two runs and the sweep page.
"""
from __future__ import annotations

import html
import json
import math
from pathlib import Path

from kit.units import fmt_quantity

CSS = """
body { font: 15px/1.45 system-ui, -apple-system, "Segoe UI", "DejaVu Sans", sans-serif;
       margin: 0 auto; max-width: 1180px; padding: 0 24px 48px; color: #1d2329; }
h1 { margin: 24px 0 4px; } h2 { margin-top: 36px; border-bottom: 1px solid #dde1e6; }
h3 { margin: 22px 0 8px; } .sub { color: #5b6570; margin: 0 0 12px; }
table { border-collapse: collapse; margin: 8px 0 16px; font-size: 14px; }
th, td { text-align: left; padding: 4px 10px; border-bottom: 1px solid #e6e9ed; vertical-align: top; }
th { background: #f4f6f8; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
code, pre { font: 13px/1.4 ui-monospace, "DejaVu Sans Mono", monospace; }
pre { background: #f6f8fa; padding: 10px; overflow-x: auto; border-radius: 4px; }
td pre { white-space: pre-wrap; overflow-wrap: anywhere; max-width: 560px; margin: 0; padding: 4px; }
.banner { padding: 12px 16px; border-radius: 6px; margin: 12px 0; font-size: 17px; }
.ok { color: #1a7f37; } .fail { color: #cf222e; font-weight: 600; }
.banner.ok { background: #dafbe1; } .banner.fail { background: #ffebe9; }
tr.fail td { background: #fff5f4; } tr.diff td { background: #fff8c5; }
.notebook { border: 1px solid #dde1e6; border-radius: 8px; padding: 4px 18px 12px; margin: 18px 0; }
.notebook.failed { border-color: #cf222e; border-width: 2px; }
.figure { width: 100%; height: 460px; margin: 8px 0 20px; }
.pair { display: grid; grid-template-columns: 1fr 1fr; gap: 16px; }
.figpair { display: grid; grid-template-columns: repeat(auto-fit, minmax(620px, 1fr)); gap: 16px; }
body.wide { max-width: 1840px; }  /* two figures side by side on a wide screen, else stacked */
details > summary { cursor: pointer; color: #0969da; margin: 6px 0; }
nav a { margin-right: 14px; }
"""


def flatten(results: dict, prefix: str = "") -> dict:
    """Nested results as one level of dotted names."""
    out = {}
    for key, value in results.items():
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def units_under(units: dict, prefix: str) -> dict:
    """The units recorded under `prefix.` (a run's `settings.` or `machine.`), by the rest of
    their names."""
    return {k[len(prefix) + 1:]: u for k, u in units.items() if k.startswith(prefix + ".")}


def is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def fmt(value, unit: str | None = None) -> str:
    """A recorded value for people, in the unit it was recorded with (`kit.units`)."""
    if isinstance(value, bool) or value is None:
        return {True: "yes", False: "no", None: "–"}[value]
    if is_number(value):
        return fmt_quantity(value, unit)
    text = value if isinstance(value, str) else json.dumps(value)
    return text if len(text) <= 160 else text[:157] + "…"


def esc(value) -> str:
    return html.escape(str(value))


def table(rows: list[list], head: list[str], row_class=None, numeric=()) -> str:
    """A table of already-escaped cells; `numeric` columns are right-aligned."""
    out = ["<table><thead><tr>", *(f"<th>{esc(h)}</th>" for h in head), "</tr></thead><tbody>"]
    for i, row in enumerate(rows):
        cls = row_class(i) if row_class else ""
        out.append(f'<tr class="{cls}">' if cls else "<tr>")
        out += [f'<td class="num">{c}</td>' if j in numeric else f"<td>{c}</td>"
                for j, c in enumerate(row)]
        out.append("</tr>")
    return "".join(out) + "</tbody></table>"


def key_values(mapping: dict, units: dict | None = None) -> str:
    """Name and value rows; `units`: each name's unit, as recorded."""
    units = units or {}
    return table([[f"<code>{esc(k)}</code>", esc(fmt(v, units.get(k)))]
                  for k, v in mapping.items()], ["name", "value"])


class Figures:
    """Figure placeholders whose plotly JSON travels in the page; one script draws them all."""

    def __init__(self):
        self.count = 0

    def div(self, path: Path, compact: bool = False) -> str:
        return self.div_json(path.stem, path.read_text(), compact)

    def div_json(self, name: str, text: str, compact: bool = False) -> str:
        """A figure from its plotly JSON text."""
        self.count += 1
        data = text.replace("</", "<\\/")  # keep "</script>" out of the JSON
        return (f'<div class="figure kit-figure{" compact" if compact else ""}" '
                f'id="figure-{self.count}" data-name="{esc(name)}"></div>'
                f'<script type="application/json" id="figure-{self.count}-json">{data}</script>')


def plotly_js() -> str:
    from plotly.offline import get_plotlyjs
    return get_plotlyjs()


DRAW_FIGURES = """
document.querySelectorAll(".kit-figure").forEach(function (div) {
  var fig = JSON.parse(document.getElementById(div.id + "-json").textContent);
  var layout = Object.assign({}, fig.layout || {}, {autosize: true});
  delete layout.width; delete layout.height;
  if (div.classList.contains("compact")) {  // half width, beside the other run's figure
    var title = typeof layout.title === "string" ? {text: layout.title} : (layout.title || {});
    layout.title = Object.assign({}, title, {font: {size: 14}});
    layout.font = {size: 11};
  }
  Plotly.newPlot(div, fig.data || [], layout, {responsive: true, displaylogo: false})
    .then(function () { div.classList.add("kit-drawn"); });
});
"""


def page(title: str, body: str, has_figures: bool, wide: bool = False) -> str:
    scripts = (f"<script>{plotly_js()}</script><script>{DRAW_FIGURES}</script>"
               if has_figures else "")
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">'
            f"<title>{esc(title)}</title><style>{CSS}</style></head>"
            f"<body{' class=wide' if wide else ''}>{body}{scripts}</body></html>")
