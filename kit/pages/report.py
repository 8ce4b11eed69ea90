"""The run report: one HTML page per run folder, and two runs side by side.

    python -m kit report RUN_FOLDER          # writes RUN_FOLDER/report.html
    python -m kit compare RUN_A RUN_B        # writes compare-A-vs-B.html beside RUN_A

The report holds the run's parameters, machine and versions (from `summary.json`), a link to
its log (`kernel.log`: the kernels' output and the libraries' logs), every notebook's results
and checks (failed notebooks first, with the failing cell), every chapter's figures
(`figures/*.json`), and links to the executed notebooks rendered as HTML. It works
offline: plotly.js is copied in once from the installed plotly package, nothing is fetched.
`python -m kit run` writes the report at the end of every run.
"""
from __future__ import annotations

import json
from pathlib import Path

from kit.errors import ConfigError
from kit.pages.findings import findings
from kit.pages.html import (Figures, esc, fmt, flatten, is_number, key_values, page, table,
                            units_under)
from kit.pages.notebook_page import notebook_pages
from kit.results import current_names

# ---------------------------------------------------------------- reading a run folder


def load_run(folder) -> dict:
    """summary.json of a run folder, each notebook's recorded results filled in (with today's
    names: a run recorded before a result was renamed reads the same)."""
    folder = Path(folder)
    path = folder / "summary.json"
    if not path.is_file():
        raise ConfigError(f"{folder} is not a run folder (no summary.json); give a folder "
                          "that `python -m kit run` wrote, e.g. runs/<stamp>-cpu-small")
    summary = json.loads(path.read_text())
    for nb in summary.get("notebooks", []):
        recorded = folder / f"{nb['notebook']}.json"
        if nb.get("recorded") is None and recorded.is_file():
            nb["recorded"] = json.loads(recorded.read_text())
        nb["recorded"] = nb.get("recorded") or {"results": {}, "checks": [], "figures": []}
        nb["recorded"]["results"] = current_names(nb["recorded"].get("results", {}))
    summary["folder"] = folder
    return summary


def figures_of(folder: Path, chapter: str) -> list[Path]:
    """The chapter's figures (plotly JSON files named CHAPTER--NAME.json)."""
    return sorted((folder / "figures").glob(f"{chapter}--*.json"))


def failures_first(notebooks: list[dict]) -> list[dict]:
    return sorted(notebooks, key=lambda nb: nb["ok"])  # stable: run order within each group


# ---------------------------------------------------------------- the report of one run

def status_banner(notebooks: list[dict]) -> str:
    failed = [nb for nb in notebooks if not nb["ok"]]
    checks = [c for nb in notebooks for c in nb["recorded"].get("checks", [])]
    passed = sum(c["ok"] for c in checks)
    if not notebooks:
        return '<div class="banner fail">No notebook ran.</div>'
    if failed:
        return (f'<div class="banner fail">{len(failed)} of {len(notebooks)} notebooks failed '
                f'({passed}/{len(checks)} checks passed): '
                + ", ".join(esc(nb["notebook"]) for nb in failed) + "</div>")
    return (f'<div class="banner ok">All {len(notebooks)} notebooks passed, '
            f"{passed}/{len(checks)} checks.</div>")


def failing_cell(nb: dict, link: str | None) -> str:
    err = nb.get("error")
    if not err:
        return ""
    where = "before any cell ran"
    if err.get("cell_index") is not None:
        where = f"cell {err['cell_index']} of the executed notebook"
        if link:  # papermill marks the failing cell with this anchor
            where = f'<a href="{esc(link)}#papermill-error-cell">{where}</a>'
    source = (f'<p class="sub">the cell:</p><pre>{esc(err["source"])}</pre>'
              if err.get("source") else "")
    return (f'<h3 class="fail">Failed in {where}: {esc(err.get("ename"))}</h3>'
            f"<pre>{esc(err.get('evalue'))}</pre>{source}")


def findings_section(notebooks: list[dict]) -> str:
    """What the run found, before the details: one row per finding, its reference beside."""
    found = findings(notebooks)
    if not found:
        return ""
    mark = {True: '<span class="ok">within target</span>',
            False: '<span class="fail">outside target</span>', None: ""}
    rows = [[f'<a href="#{esc(f.chapter)}">{esc(f.chapter[:2])}</a>', esc(f.question),
             f"<b>{esc(f.found)}</b> {mark[f.ok]}", esc(f.reference)] for f in found]
    return ('<section id="findings"><h2>What this run found</h2>'
            + table(rows, ["", "question", "measured here", "beside it"]) + "</section>")


def checks_table(checks: list[dict]) -> str:
    if not checks:
        return '<p class="fail">No checks recorded.</p>'
    ordered = sorted(checks, key=lambda c: c["ok"])
    rows = [['<span class="ok">PASS</span>' if c["ok"] else '<span class="fail">FAIL</span>',
             esc(c["name"]), esc(c.get("detail", ""))] for c in ordered]
    return table(rows, ["", "check", "detail"],
                 row_class=lambda i: "" if ordered[i]["ok"] else "fail")


def notebook_section(folder: Path, nb: dict, link: str | None, figs: Figures) -> str:
    rec = nb["recorded"]
    checks = rec.get("checks", [])
    passed = sum(c["ok"] for c in checks)
    status = '<span class="ok">ok</span>' if nb["ok"] else '<span class="fail">FAILED</span>'
    links = (f'<a href="{esc(link)}">executed notebook</a> · ' if link else "") + \
        f'<a href="{esc(nb["notebook"])}.ipynb">.ipynb</a>'
    parts = [f'<section class="notebook{"" if nb["ok"] else " failed"}" id="{esc(nb["notebook"])}">',
             f'<h2>{esc(nb["notebook"])} {status}</h2>',
             f'<p class="sub">{passed}/{len(checks)} checks passed · '
             f'{nb.get("seconds", 0):.1f} s · {links}</p>',
             failing_cell(nb, link), "<h3>Checks</h3>", checks_table(checks)]
    results = flatten(rec.get("results", {}))
    if results:
        parts += [f"<details{' open' if len(results) <= 40 else ''}><summary>Results "
                  f"({len(results)} recorded)</summary>", key_values(results, rec.get("units")),
                  "</details>"]
    paths = figures_of(folder, nb["notebook"])
    if paths:
        parts.append("<h3>Figures</h3>")
        parts += [figs.div(p) for p in paths]
    return "".join(parts) + "</section>"


def log_link(run: dict) -> str:
    """A link to the run's log (the kernels' output, the libraries' logs), when it has one."""
    log = run.get("log")
    if not log or not (run["folder"] / log).is_file():
        return ""
    return (f'kernels\' output and logs: <a href="{esc(log)}" id="run-log"><code>{esc(log)}'
            "</code></a> · ")


def render_report(folder, links: dict | None = None) -> str:
    """The report page of one run folder, as HTML text."""
    run = load_run(folder)
    folder = run["folder"]
    notebooks = failures_first(run.get("notebooks", []))
    links = links or {}
    figs = Figures()
    nav = " ".join(f'<a href="#{esc(nb["notebook"])}" class="{"ok" if nb["ok"] else "fail"}">'
                   f'{esc(nb["notebook"])}</a>' for nb in notebooks)
    params, units = run.get("parameters") or {}, run.get("units", {})
    body = [f"<h1>Run {esc(folder.name)}</h1>",
            f'<p class="sub">preset <code>{esc(run.get("preset"))}</code> · device '
            f'<code>{esc(run.get("machine", {}).get("device"))}</code> · '
            f'{run.get("seconds", 0):.0f} s in all · {log_link(run)}'
            'written by <code>python -m kit report</code></p>',
            status_banner(notebooks), findings_section(notebooks), f"<nav>{nav}</nav>",
            "<h2>Parameters</h2>",
            f"<p>Overrides of the preset: {esc(params) if params else 'none'}.</p>",
            key_values(run.get("settings", {}), units_under(units, "settings")),
            "<h2>Machine and versions</h2>", '<div class="pair"><div>',
            key_values(flatten(run.get("machine", {})), units_under(units, "machine")),
            "</div><div>",
            key_values(run.get("versions", {})), "</div></div>"]
    body += [notebook_section(folder, nb, links.get(nb["notebook"]), figs) for nb in notebooks]
    return page(f"Run {folder.name}", "".join(body), figs.count > 0)


def write_report(folder) -> Path:
    """Render the executed notebooks and write FOLDER/report.html; returns its path."""
    folder = Path(folder)
    run = load_run(folder)
    links = notebook_pages(folder, run.get("notebooks", []))
    out = folder / "report.html"
    out.write_text(render_report(folder, links), encoding="utf-8")
    return out


def write_report_safely(folder) -> Path | None:
    """What `python -m kit run` calls: a report that cannot be written never fails the run."""
    try:
        path = write_report(folder)
    except Exception as e:
        print(f"report: not written ({type(e).__name__}: {e}); "
              f"try `python -m kit report {folder}`")
        return None
    print(f"report: {path}")
    return path


# ---------------------------------------------------------------- two runs side by side

def recorded_of(run: dict, chapter: str) -> dict:
    return next((nb["recorded"] for nb in run["notebooks"] if nb["notebook"] == chapter), {})


def numeric_rows(a: dict, b: dict) -> list[tuple[str, str, object, object, str | None]]:
    """(chapter, name, A, B, unit) for every recorded number of either run (the unit B's
    record gives, else A's)."""
    rows = []
    chapters = list(dict.fromkeys([nb["notebook"] for nb in a["notebooks"] + b["notebooks"]]))
    for chapter in chapters:
        rec_a, rec_b = recorded_of(a, chapter), recorded_of(b, chapter)
        ra, rb = flatten(rec_a.get("results", {})), flatten(rec_b.get("results", {}))
        units = {**rec_a.get("units", {}), **rec_b.get("units", {})}
        for name in dict.fromkeys([*ra, *rb]):
            va, vb = ra.get(name), rb.get(name)
            if is_number(va) or is_number(vb):
                rows.append((chapter, name, va, vb, units.get(name)))
    return rows


def ratio(va, vb) -> float | None:
    return vb / va if is_number(va) and is_number(vb) and va != 0 else None


def side_by_side(title: str, a: dict, b: dict, units: dict | None = None) -> str:
    keys, units = list(dict.fromkeys([*a, *b])), units or {}
    rows = [[f"<code>{esc(k)}</code>", esc(fmt(a.get(k), units.get(k))),
             esc(fmt(b.get(k), units.get(k)))] for k in keys]
    return f"<h3>{esc(title)}</h3>" + table(
        rows, ["name", "A", "B"], row_class=lambda i: "diff" if a.get(keys[i]) != b.get(keys[i]) else "")


def render_compare(folder_a, folder_b) -> str:
    """Two runs side by side: what differs, every recorded number with B/A, the figures."""
    a, b = load_run(folder_a), load_run(folder_b)
    name_a, name_b = a["folder"].name, b["folder"].name
    figs = Figures()
    status = {nb["notebook"]: {} for nb in a["notebooks"] + b["notebooks"]}
    for side, run in (("A", a), ("B", b)):
        for nb in run["notebooks"]:
            checks = nb["recorded"].get("checks", [])
            status[nb["notebook"]][side] = (
                f'<span class="{"ok" if nb["ok"] else "fail"}">{"ok" if nb["ok"] else "FAILED"}'
                f'</span> {sum(c["ok"] for c in checks)}/{len(checks)} checks, {nb.get("seconds", 0):.1f} s')
    rows = numeric_rows(a, b)
    ratios = [ratio(va, vb) for _, _, va, vb, _ in rows]
    units = {**a.get("units", {}), **b.get("units", {})}
    body = [f"<h1>{esc(name_a)} vs {esc(name_b)}</h1>",
            f'<p class="sub">A = <code>{esc(a["folder"])}</code><br>B = <code>{esc(b["folder"])}</code>'
            "<br>Rows that differ are highlighted (numbers: by more than 1%); ratios are B ÷ A."
            "</p>",
            "<h2>Notebooks</h2>",
            table([[esc(n), s.get("A", "–"), s.get("B", "–")] for n, s in status.items()],
                  ["notebook", "A", "B"]),
            "<h2>What differs</h2>",
            side_by_side("Parameters", {"preset": a.get("preset"), **(a.get("parameters") or {})},
                         {"preset": b.get("preset"), **(b.get("parameters") or {})}),
            side_by_side("Settings", a.get("settings", {}), b.get("settings", {}),
                         units_under(units, "settings")),
            side_by_side("Machine", flatten(a.get("machine", {})), flatten(b.get("machine", {})),
                         units_under(units, "machine")),
            side_by_side("Versions", a.get("versions", {}), b.get("versions", {})),
            f"<h2>Recorded numbers ({len(rows)})</h2>",
            table([[esc(ch), f"<code>{esc(n)}</code>", esc(fmt(va, u)), esc(fmt(vb, u)),
                    "–" if r is None else f"{r:.4g}×"]
                   for (ch, n, va, vb, u), r in zip(rows, ratios)],
                  ["chapter", "result", "A", "B", "B ÷ A"], numeric={2, 3, 4},
                  row_class=lambda i: "diff" if ratios[i] is not None and abs(ratios[i] - 1) > 0.01
                  else ""),
            "<h2>Figures</h2>"]
    names = sorted({p.name for run in (a, b) for p in (run["folder"] / "figures").glob("*.json")})
    for name in names:
        pair = {side: run["folder"] / "figures" / name for side, run in (("A", a), ("B", b))}
        body.append(f"<h3>{esc(Path(name).stem)}</h3>")
        if all(p.is_file() for p in pair.values()):
            body += ['<div class="figpair">', *(f'<div><p class="sub">{side}</p>{figs.div(p, True)}'
                                             "</div>" for side, p in pair.items()), "</div>"]
        else:  # in one run only: full width
            side, p = next((side, p) for side, p in pair.items() if p.is_file())
            body += [f'<p class="sub">only in {side}</p>', figs.div(p)]
    return page(f"{name_a} vs {name_b}", "".join(body), figs.count > 0, wide=True)


def write_compare(folder_a, folder_b, out=None) -> Path:
    """Write the comparison page (default: compare-A-vs-B.html beside run A)."""
    folder_a, folder_b = Path(folder_a), Path(folder_b)
    out = Path(out) if out else folder_a.parent / f"compare-{folder_a.name}-vs-{folder_b.name}.html"
    out.write_text(render_compare(folder_a, folder_b), encoding="utf-8")
    return out


def add_cli(sub) -> None:
    """The `report` and `compare` commands of `python -m kit`."""
    p = sub.add_parser("report", help="write a run folder's report.html (offline HTML page)")
    p.add_argument("run", type=Path, help="a folder written by `python -m kit run`")
    p.set_defaults(func=lambda a: print(f"report: {write_report(a.run)}") or 0)
    p = sub.add_parser("compare", help="two runs side by side (numbers with ratios, figures)")
    p.add_argument("run_a", type=Path)
    p.add_argument("run_b", type=Path)
    p.add_argument("--out", type=Path, help="the HTML file to write (default: beside RUN_A)")
    p.set_defaults(func=lambda a: print(f"compare: {write_compare(a.run_a, a.run_b, a.out)}") or 0)
