"""`sweep.html`: one offline page for a sweep folder (kit/sweep/driver.py), like the run report.

The points as a table (failed ones first, each linking to its run's report), how the sweep ran
(where, how many points at once, on which node), and for every recorded number that varies a
figure of it against each grid parameter, one line per combination of the other parameters'
values. A sweep of chapter 01 over `max_num_batched_tokens` also gets the PR's curve.
"""
from __future__ import annotations

import itertools
import json
from pathlib import Path

from kit.config import reference
from kit.errors import ConfigError
from kit.pages.html import Figures, esc, fmt, is_number, key_values, page, table
from kit.results import current_names

SWEEP_FILE = "sweep.json"

PR_CHAPTER = "01_memory_profiling"
PR_PARAMETER = "max_num_batched_tokens"


def load_sweep(folder) -> dict:
    path = Path(folder) / SWEEP_FILE
    if not path.is_file():
        raise ConfigError(f"{folder} is not a sweep folder (no {SWEEP_FILE}); give a folder "
                          "that `python -m kit sweep` wrote, e.g. runs/sweep-<stamp>-cpu-small")
    sweep = json.loads(path.read_text())
    for point in sweep.get("points", []):
        point["results"] = current_names(point.get("results") or {})
    return sweep


def machine(point: dict) -> tuple | None:
    node = point.get("node")
    return (node["hostname"], node["ip"]) if node else None


def at_once(point: dict, points: list[dict], same_machine: bool = False) -> int:
    """The most points running at the same time while `point` ran (itself included): in all,
    or on its machine (where they share cores and memory bandwidth)."""
    def ran(p):
        return p.get("started") is not None and p.get("ended") is not None
    if not ran(point):
        return 0
    others = [p for p in points if ran(p) and (not same_machine or machine(p) == machine(point))]
    moments = [p["started"] for p in others if point["started"] <= p["started"] < point["ended"]]
    return max(sum(p["started"] <= t < p["ended"] for p in others) for t in moments)


def node_label(point: dict) -> str:
    node = point.get("node")
    if not node:
        return "–"
    nice = f", nice {node['niceness']}" if node.get("niceness") else ""
    return f"{node['node_id'][:8]} ({node['hostname']}, {node['ip']}{nice})"


def varying_numbers(points: list[dict]) -> dict[str, list]:
    """Recorded numbers that differ between points, in recorded order: name -> values."""
    names = list(dict.fromkeys(n for p in points for n in p.get("results") or {}))
    values = {n: [(p.get("results") or {}).get(n) for p in points] for n in names}
    return {n: v for n, v in values.items() if len({x for x in v if x is not None}) > 1}


def units_of(points: list[dict]) -> dict:
    """The units the points recorded, by `<chapter>.<dotted name>`."""
    return {n: u for p in points for n, u in (p.get("units") or {}).items()}


def constant_numbers(points: list[dict]) -> dict:
    ran = [p for p in points if p.get("results")]
    if not ran:
        return {}
    return {n: v for n, v in ran[0]["results"].items()
            if all(p["results"].get(n) == v for p in ran)}


def curve_lines(sweep: dict, name: str, parameter: str) -> list[tuple[str, list, list, list]]:
    """The lines of `name` against `parameter`: one per combination of the other grid values."""
    others = [k for k in sweep["grid"] if k != parameter]
    lines = []
    for combo in itertools.product(*(sweep["grid"][k] for k in others)):
        fixed = dict(zip(others, combo))
        xs, ys, names = [], [], []
        for x in sweep["grid"][parameter]:
            p = next(p for p in sweep["points"] if p["parameters"] == {**fixed, parameter: x})
            value = (p.get("results") or {}).get(name)
            if value is not None:
                xs.append(x), ys.append(value), names.append(p["name"])
        if xs:
            lines.append((", ".join(f"{k}={v}" for k, v in fixed.items()), xs, ys, names))
    return lines


def pr_series(sweep: dict) -> list[tuple[str, list, list, list]]:
    """(label, tokens, eager blocks, compiled blocks) for the PR's curve, when the sweep ran
    chapter 01 over max_num_batched_tokens; else []."""
    if PR_PARAMETER not in sweep["grid"]:
        return []
    eager = curve_lines(sweep, f"{PR_CHAPTER}.kv_blocks.eager", PR_PARAMETER)
    compiled = curve_lines(sweep, f"{PR_CHAPTER}.kv_blocks.compiled", PR_PARAMETER)
    series = []
    for (label, xs, e, _), (_, xs2, c, _) in zip(eager, compiled):
        if xs == xs2:
            series.append((label, xs, e, c))
    return series


def where(point: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in point["parameters"].items())


def findings_section(sweep: dict, shown: int = 8) -> str:
    """What the sweep found, before the details: each recorded number that moved, its
    smallest and largest value and where, and largest ÷ smallest."""
    ran = [p for p in sweep["points"] if p.get("results")]
    moved = {n: v for n, v in varying_numbers(ran).items() if all(map(is_number, v))}
    if not moved:
        return ""
    rows, units = [], units_of(ran)
    for name, values in list(moved.items())[:shown]:
        lo, hi = (min(zip(values, ran), key=lambda vp: vp[0] * sign) for sign in (1, -1))
        ratio = f"{hi[0] / lo[0]:.3g}×" if lo[0] > 0 else "–"
        unit = units.get(name)
        rows.append([f"<code>{esc(name)}</code>", f"<b>{esc(fmt(lo[0], unit))}</b> at "
                     f"{esc(where(lo[1]))}", f"<b>{esc(fmt(hi[0], unit))}</b> at "
                     f"{esc(where(hi[1]))}", ratio])
    more = (f"<p class=\"sub\">and {len(moved) - shown} more, in the figures below</p>"
            if len(moved) > shown else "")
    return ('<section id="findings"><h2>What the sweep found</h2>'
            f"<p>Over {len(ran)} points, {len(moved)} recorded number"
            f"{'s' if len(moved) != 1 else ''} moved:</p>"
            + table(rows, ["number", "smallest", "largest", "largest ÷ smallest"],
                    numeric={3}) + more + "</section>")


def points_table(sweep: dict) -> str:
    points = sorted(sweep["points"], key=lambda p: p["status"] == "ok")  # failed first
    names = list(sweep["grid"])
    rows = []
    for p in points:
        ok = p["status"] == "ok"
        status = f'<span class="{"ok" if ok else "fail"}">{esc(p["status"])}</span>'
        report = Path(p.get("folder") or "") / "report.html"
        link = (f'<a href="{esc(report)}">{esc(p["name"])}</a>' if p.get("folder")
                else esc(p["name"]))
        rows.append([link, *(esc(p["parameters"][n]) for n in names), status,
                     "–" if p.get("seconds") is None else f"{p['seconds']:.1f} s",
                     esc(node_label(p)), str(at_once(p, sweep["points"]) or "–"),
                     str(at_once(p, sweep["points"], same_machine=True) or "–"),
                     f"<pre>{esc(p['error'])}</pre>" if p.get("error") else ""])
    head = ["point", *names, "status", "seconds", "node", "at once", "on its machine", "error"]
    return table(rows, head, row_class=lambda i: "" if points[i]["status"] == "ok" else "fail",
                 numeric={len(names) + 2, len(names) + 4, len(names) + 5})


def how_it_ran(sweep: dict) -> str:
    runs = [[esc(r.get("address")), str(r.get("parallel")), str(r.get("nodes")),
             str(r.get("gpus") or 0),
             "–" if r.get("ended") is None else f"{r['ended'] - r['started']:.0f} s"]
            for r in sweep.get("runs", [])]
    nodes = {}
    for p in sweep["points"]:
        if p.get("node"):
            nodes.setdefault(node_label(p), []).append(p["name"])
    most = max((at_once(p, sweep["points"]) for p in sweep["points"]), default=0)
    shared = max((at_once(p, sweep["points"], True) for p in sweep["points"]), default=0)
    return ("<h2>How it ran</h2>"
            f"<p>At most <b>{most}</b> point{'s' if most != 1 else ''} ran at once, at most "
            f"<b>{shared}</b> on one machine. Points that share a machine share its cores and "
            "memory bandwidth: compare timings only between points that had their machine to "
            "themselves (column <i>on its machine</i> = 1), on like machines.</p>"
            + table(runs, ["Ray", "--parallel", "nodes", "GPUs",
                           "wall time (Ray's start and stop included)"])
            + table([[esc(n), str(len(ps)), esc(", ".join(ps))] for n, ps in nodes.items()],
                    ["node", "points", "which"]))


def figures(sweep: dict, figs: Figures) -> str:
    from kit.show import plots
    ran = [p for p in sweep["points"] if p.get("results")]
    out = []
    series = pr_series(sweep)
    if series:
        out += ["<h2>The PR's curve</h2>",
                "<p>KV cache blocks left by the eager and the compiled profile as the profiled "
                "token count grows, and their ratio; the star is the PR's Gemma-2B point "
                "(vLLM PR 7796) on its GPU. Chapter 01 explains why the ratio depends on how "
                "tight the device is.</p>",
                figs.div_json("sweep--pr_curve",
                              plots.pr_curve(series, reference("pr7796")).to_json())]
    swept = [k for k, v in sweep["grid"].items() if len(v) > 1]
    varying = varying_numbers(ran)
    out.append(f"<h2>Numbers that vary ({len(varying)})</h2>")
    if not swept or not varying:
        out.append("<p>Nothing to draw: " + ("no parameter takes two values." if not swept else
                   "no recorded number differs between the points that ran.") + "</p>")
    chapters = list(dict.fromkeys(n.split(".", 1)[0] for n in varying))
    for chapter in chapters:
        out += [f"<h3>{esc(chapter)}</h3>", '<div class="figpair">']
        for name in (n for n in varying if n.startswith(chapter + ".")):
            for parameter in swept:
                fig = plots.sweep_curve(name.split(".", 1)[1], parameter,
                                        curve_lines(sweep, name, parameter))
                out.append(f"<div>{figs.div_json(f'{name}--{parameter}', fig.to_json(), True)}"
                           "</div>")
        out.append("</div>")
    constant = constant_numbers(ran)
    if constant:
        out += [f"<details><summary>Numbers the same at every point ({len(constant)})</summary>",
                key_values(constant, units_of(ran)), "</details>"]
    return "".join(out)


def render(folder) -> str:
    folder = Path(folder)
    sweep = load_sweep(folder)
    points = sweep["points"]
    failed = [p for p in points if p["status"] != "ok"]
    figs = Figures()
    grid = " × ".join(f"<code>{esc(k)}</code> ∈ {{{esc(', '.join(map(str, v)))}}}"
                      for k, v in sweep["grid"].items())
    banner = (f'<div class="banner fail">{len(failed)} of {len(points)} points did not finish '
              f'ok: resume with <code>python -m kit sweep --resume {esc(folder)}</code></div>'
              if failed else f'<div class="banner ok">All {len(points)} points ran ok.</div>')
    body = [f"<h1>Sweep {esc(folder.name)}</h1>",
            f'<p class="sub">preset <code>{esc(sweep["preset"])}</code> · notebooks '
            + ", ".join(f"<code>{esc(Path(n).stem)}</code>" for n in sweep["notebooks"])
            + f" · grid {grid} · "
            + (f"fixed {esc(sweep['fixed'])}" if sweep["fixed"] else
               "every other parameter at the preset's value")
            + " · written by <code>python -m kit sweep</code></p>", banner,
            findings_section(sweep), "<h2>Points</h2>", points_table(sweep), how_it_ran(sweep),
            figures(sweep, figs)]
    return page(f"Sweep {folder.name}", "".join(body), figs.count > 0, wide=True)


def write_page(folder) -> Path:
    out = Path(folder) / "sweep.html"
    out.write_text(render(folder), encoding="utf-8")
    return out
