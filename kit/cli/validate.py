"""`python -m kit validate`: the prepared run for a GPU's first minutes. On a bare H100 or H200
(torch with CUDA, set up by `./setup.sh`, offline from a wheel folder if need be) it runs, in
order and within one time limit (default 9 minutes):

    machine         the device, the software, the C and C++ compilers
    probe           exact allocation (N bytes measure N bytes); what the first GEMM keeps
    profiles        chapter 01's eager and compiled profiles (cuBLAS's workspace warmed first)
    decode          `kit bench decode`: eager, guard-free and CUDA graphs, logits checked
    profiler_table  a decode step's profiler events per strategy (the breakdown's fixture)
    chapters        `kit run 00 01 02 03 04` on the preset

and writes one folder: each step's JSON and log, the chapters' run folder, and `summary.json`
and `summary.md` saying what held. Each step runs in a child process with its own share of the
time left, so a crash or a hang in one leaves the others standing; this process never touches
CUDA. The cheap steps come first, the chapters last: when time runs out they are the ones cut
(the chapters' own summary.json is written after each notebook, so what finished is kept).
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from kit.config import load
from kit.errors import ConfigError
from kit.execute.notebooks import parse_params
from kit.results import RUNS_DIR, new_run_dir

CHAPTERS = ("00", "01", "02", "03", "04")


@dataclass(frozen=True)
class Step:
    name: str
    what: str
    max_seconds: int       # its share; never more than what is left of the whole limit

    def command(self, folder: Path, preset: str, params: list[str], device: str) -> list[str]:
        p = [arg for pair in params for arg in ("-p", pair)]
        kit = [sys.executable, "-m", "kit"]
        if self.name == "decode":
            strategies = "eager,guard_free" + (",cuda_graphs" if device == "cuda" else "")
            return kit + ["bench", "decode", "--preset", preset, *p,
                          "-p", f"strategies={strategies}", "--out", str(folder / "decode.json")]
        if self.name == "chapters":
            return kit + ["run", *CHAPTERS, "--preset", preset, *p, "--no-progress",
                          "--out", str(folder / "chapters")]
        return [sys.executable, "-m", "kit.cli.validate_steps", self.name, str(folder),
                "--preset", preset, *p]


STEPS = (Step("machine", "the device, the software, the compilers", 60),
         Step("probe", "exact allocation; what the first GEMM keeps", 60),
         Step("profiles", "chapter 01's eager and compiled profiles", 180),
         Step("decode", "decode bench: eager, guard-free (CUDA graphs on a GPU), logits checked",
              180),
         Step("profiler_table", "a decode step's profiler events per strategy", 90),
         Step("chapters", f"chapters {', '.join(CHAPTERS)} headless", 600))


def run_step(step: Step, folder: Path, preset: str, params: list[str], device: str,
             seconds: float) -> dict:
    """Run one step in a child process (its output to `<step>.log`) for at most `seconds`;
    return its status and what it measured."""
    log = folder / f"{step.name}.log"
    t0 = time.perf_counter()
    status = {"step": step.name, "what": step.what, "limit_seconds": round(seconds)}
    if seconds < 5:
        return {**status, "ok": False, "seconds": 0.0, "error": "no time left"}
    with log.open("w") as out:
        try:
            rc = subprocess.run(step.command(folder, preset, params, device), stdout=out,
                                stderr=subprocess.STDOUT, timeout=seconds).returncode
            error = None if rc == 0 else f"exit status {rc} (see {log.name})"
        except subprocess.TimeoutExpired:
            rc, error = None, f"stopped after {seconds:.0f} s, its share of the time"
    status.update(ok=rc == 0, seconds=round(time.perf_counter() - t0, 1), error=error)
    status.update(findings(step.name, folder))
    return status


def findings(name: str, folder: Path) -> dict:
    """What a finished (or stopped) step left in the folder: its claims and key numbers."""
    if name == "decode":
        path = folder / "decode.json"
        if not path.exists():
            return {}
        report = json.loads(path.read_text())
        held = [{"claim": f"{k}: logits within tolerance of the no-cache reference",
                 "ok": bool((t.get("correctness") or {}).get("ok"))}
                for k, t in report["strategies"].items()]
        steps = {k: t["median_step_seconds"] for k, t in report["strategies"].items()}
        notes = [f"{k}: median step {v * 1e3:.3f} ms, "
                 f"{report['strategies'][k].get('percent_of_floor') or 0:.0f}% of the floor"
                 for k, v in steps.items()]
        return {"held": held, "median_step_seconds": steps, "notes": notes}
    if name == "chapters":
        runs = sorted((folder / "chapters").glob("*/summary.json"))
        if not runs:
            return {}
        summary = json.loads(runs[-1].read_text())
        return {"run_folder": str(runs[-1].parent),
                "held": [{"claim": f"chapter {nb['notebook']}: "
                                   f"{nb['checks_passed']} checks passed",
                          "ok": bool(nb["ok"])} for nb in summary["notebooks"]]}
    path = folder / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else {}


def summary_lines(summary: dict) -> list[str]:
    """summary.md: one line per step, then its claims."""
    lines = [f"# Validation on {summary['device']} ({summary['preset']})", "",
             f"{sum(s['ok'] for s in summary['steps'])} of {len(summary['steps'])} steps "
             f"held in {summary['seconds']:.0f} s (limit {summary['limit_seconds']} s)", ""]
    for s in summary["steps"]:
        state = "held" if s["ok"] else f"FAILED: {s['error']}"
        lines.append(f"- **{s['step']}** ({s['what']}), {s['seconds']} s: {state}")
        lines += [f"  - {'ok' if h['ok'] else 'NOT'}: {h['claim']}" for h in s.get("held", [])]
        lines += [f"  - {note}" for note in s.get("notes", [])]
    return lines


def validate_gpu(preset: str = "gpu", params: list[str] = (), out: Path | None = None,
             limit_seconds: int = 540, only: list[str] | None = None) -> tuple[int, Path]:
    """Run the steps (or `only` those named) in order within `limit_seconds`; write the
    folder's summary after each step. Returns (exit status, folder)."""
    settings = load(preset, **parse_params(list(params)))  # refuses a missing GPU, bad values
    steps = [s for s in STEPS if not only or s.name in only]
    unknown = set(only or ()) - {s.name for s in STEPS}
    if unknown:
        raise ConfigError(f"unknown steps {sorted(unknown)}: give some of "
                          f"{[s.name for s in STEPS]}")
    folder = new_run_dir(Path(out or RUNS_DIR), preset, prefix="validate-")
    t0 = time.perf_counter()
    summary = {"preset": preset, "parameters": list(params), "device": settings.device,
               "limit_seconds": limit_seconds, "steps": []}
    for step in steps:
        left = limit_seconds - (time.perf_counter() - t0)
        print(f"[{step.name}] {step.what} (up to {min(step.max_seconds, left):.0f} s) ...",
              flush=True)
        status = run_step(step, folder, preset, list(params), settings.device,
                          min(step.max_seconds, left))
        print(f"[{step.name}] {'held' if status['ok'] else status['error']}", flush=True)
        summary["steps"].append(status)
        summary["seconds"] = round(time.perf_counter() - t0, 1)
        (folder / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
        (folder / "summary.md").write_text("\n".join(summary_lines(summary)) + "\n")
    print("\n".join(summary_lines(summary)))
    print(f"\nwrote {folder}")
    return (0 if all(s["ok"] for s in summary["steps"]) else 1), folder


def add_cli(sub) -> None:
    """The `validate` command of `python -m kit`."""
    p = sub.add_parser("validate", help="the prepared GPU validation run: probes, profiles, "
                       "decode bench, chapters 00-04, one folder with a summary")
    p.add_argument("--preset", default="gpu")
    p.add_argument("-p", "--param", action="append", default=[], metavar="NAME=VALUE")
    p.add_argument("--out", type=Path, help="where the folder goes (default ./runs)")
    p.add_argument("--limit", type=int, default=540, help="seconds for all steps (default 540)")
    p.add_argument("--only", nargs="*", help=f"some of {[s.name for s in STEPS]}")
    p.set_defaults(func=lambda a: validate_gpu(a.preset, a.param, a.out, a.limit, a.only)[0])
