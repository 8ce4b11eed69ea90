"""Run the chapters headless with papermill, collect their results, and say what failed.

    python -m kit run [--preset NAME] [NOTEBOOK ...] [-p NAME=VALUE ...] [--out DIR]
                      [--no-progress] [--verbose]

Each run gets a new folder (never overwriting an earlier one) holding the executed notebooks,
each chapter's recorded results and checks (JSON), its figures, `summary.json` with the
parameters, device and versions, `kernel.log` (the kernels' output and the libraries' logs,
kit/execute/runlog.py) and `report.html` (kit/pages/report.py). On a terminal each notebook has
one live line (kit/execute/progress.py). A failing notebook does not stop the others; the
summary names its failing cell. The exit status is non-zero when any notebook or check failed.
"""
from __future__ import annotations

import ast
import json
import os
import shutil
import sys
import time
from pathlib import Path

from kit.config import DATA, DEFAULT_PRESET, PARAMETERS, PRESETS_DIR, known_names, load
from kit.errors import ConfigError
from kit.execute.progress import Progress
from kit.execute.runlog import LOG_NAME, RunLog
from kit.execute.stored_notebooks import CHAPTER_GLOB
from kit.results import RUN_DIR_ENV, new_run_dir, plain

NOTEBOOKS_DIR = DATA.parent / "notebooks"


def find_notebooks(names: list[str]) -> list[Path]:
    """All chapters in order, or those named by path, file stem or number prefix ("01")."""
    chapters = sorted(NOTEBOOKS_DIR.glob(CHAPTER_GLOB))
    if not names:
        return chapters
    found = []
    for name in names:
        path = Path(name)
        if path.suffix == ".ipynb" and path.is_file():
            found.append(path.resolve())
            continue
        matches = [c for c in chapters if c.stem == name or c.stem.startswith(name + "_")]
        if len(matches) != 1:
            raise ConfigError(f"unknown notebook {name!r}: give a path or one of "
                              f"{[c.stem for c in chapters]}")
        found.append(matches[0])
    return found


def parse_params(pairs: list[str]) -> dict:
    """NAME=VALUE pairs; VALUE is a Python literal when it parses as one, else a string."""
    params = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise ConfigError(f"-p {pair!r}: write NAME=VALUE")
        try:
            params[name] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            params[name] = value
    return params


def notebook_parameters(path: Path) -> set[str]:
    import papermill
    return set(papermill.inspect_notebook(str(path)))


def validate(preset: str, notebooks: list[Path], params: dict) -> dict[Path, set[str]]:
    """Refuse unknown names and bad values before any notebook runs."""
    declared = {nb: notebook_parameters(nb) for nb in notebooks}
    known = set().union(*declared.values()) if declared else set()
    unknown = sorted(set(params) - known)
    if unknown:
        raise ConfigError(f"unknown parameter(s) {unknown}; these notebooks take "
                          f"{sorted(known - {'preset'})}")
    load(preset, **settings_params(params))
    if params.get("vllm_log"):  # chapter 06's log: read before any notebook runs
        from kit.vllm.startup_log import read_log_file
        read_log_file(params["vllm_log"])
    return declared


def settings_params(params: dict) -> dict:
    """The parameters that are settings (`kit.config.settings.PARAMETERS`); the others belong
    to one chapter (06's log and its model)."""
    return {k: v for k, v in params.items() if k in PARAMETERS}


def kernel_env() -> dict:
    """The kernels' environment: this process's, with this kit's folder first on PYTHONPATH, so
    a kernel imports the kit that runs it, not another checkout installed in the same venv.
    Without pytest's PYTEST_CURRENT_TEST: with it, ipykernel leaves file descriptors 1 and 2
    unwatched, so C-level prints that JupyterLab shows under a cell would not reach the
    notebook of a run started from a test."""
    paths = [str(DATA.parent), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
    return {**env, "PYTHONPATH": os.pathsep.join(paths)}


def execute(nb: Path, run: Path, parameters: dict, log: RunLog, progress: Progress) -> dict:
    """Run one notebook (its kernel's output to `log`, its cells and printed lines to
    `progress`); return its status (and failing cell) plus its recorded results."""
    import papermill

    from kit.execute.papermill_engine import ENGINE_NAME, Watch
    out = run / nb.name
    t0 = time.perf_counter()
    status = {"notebook": nb.stem, "executed": str(out), "ok": True, "error": None}
    try:
        with log.kernel_output() as kernel_output:
            papermill.execute_notebook(str(nb), str(out), parameters=parameters, cwd=str(run),
                                       kernel_name="python3", progress_bar=False,
                                       engine_name=ENGINE_NAME, kernel_output=kernel_output,
                                       kernel_env=kernel_env(), watch=Watch(progress, log))
    except papermill.PapermillExecutionError as e:
        status.update(ok=False, error={"cell_index": e.cell_index,
                                       "execution_count": e.exec_count,
                                       "ename": e.ename, "evalue": e.evalue,
                                       "source": e.source})
    except Exception as e:  # a kernel that died or a notebook that would not start
        status.update(ok=False, error={"cell_index": None, "ename": type(e).__name__,
                                       "evalue": str(e)})
    status["seconds"] = round(time.perf_counter() - t0, 2)
    recorded = run / f"{nb.stem}.json"
    status["recorded"] = json.loads(recorded.read_text()) if recorded.is_file() else None
    checks = (status["recorded"] or {}).get("checks", [])
    status["checks_failed"] = [c["name"] for c in checks if not c["ok"]]
    status["checks_passed"] = sum(c["ok"] for c in checks)
    status["ok"] = status["ok"] and not status["checks_failed"]
    return status


def describe_failure(s: dict) -> str:
    if s["ok"]:
        return ""
    err = s["error"]
    # the index counts cells of the executed copy, which holds papermill's injected parameters
    where = f"cell {err['cell_index']}: " if err and err.get("cell_index") is not None else ""
    what = f"{where}{err['ename']}: {err['evalue']}" if err else ""
    if s["checks_failed"]:
        what += (" | " if what else "") + "failed checks: " + "; ".join(s["checks_failed"])
    return what.splitlines()[0] if what else "failed"


def result_line(index: int, total: int, s: dict) -> str:
    """A notebook's line once it ended: ok or FAILED, seconds, checks, what failed."""
    checks = s["checks_passed"] + len(s["checks_failed"])
    return (f"[{index}/{total}] {s['notebook']}: {'ok' if s['ok'] else 'FAILED'} in "
            f"{s['seconds']:.1f} s, {s['checks_passed']}/{checks} checks "
            f"{describe_failure(s)}").rstrip()


def print_summary(statuses: list[dict], run: Path) -> None:
    print(f"\n{'notebook':<28} {'status':<6} {'checks':>7} {'seconds':>8}  detail")
    for s in statuses:
        n = s["checks_passed"] + len(s["checks_failed"])
        print(f"{s['notebook']:<28} {'ok' if s['ok'] else 'FAIL':<6} "
              f"{s['checks_passed']:>3}/{n:<3} {s['seconds']:>8.1f}  {describe_failure(s)}")
    print(f"\nrun folder: {run}")
    print(f"kernel output and logs: {run / LOG_NAME}")


def add_measured_hardware(machine: dict, units: dict, chapter: str,
                          recorded: dict | None) -> None:
    """Into summary.json's machine section: what `chapter` measured of the hardware (its
    results' `hardware`, `kit.measure.dtype_speed.hardware_figures`), the first chapter to measure
    a figure keeping it (chapter 00 measures every dtype); their units go into `units`."""
    measured = ((recorded or {}).get("results") or {}).get("hardware")
    if measured:
        section = machine.setdefault("measured", {})
        for key, value in measured.items():
            if key not in section:
                section[key] = value
                unit = recorded.get("units", {}).get(f"hardware.{key}")
                if unit:
                    units[f"machine.measured.{key}"] = unit
        section.setdefault("measured_by", chapter)


def run_notebooks(notebooks: list[Path], run_path: Path, nb_params: dict, summary: dict,
                  animate: bool, verbose: bool) -> None:
    """Run each notebook in turn, its line on the terminal, the noise in the run's log;
    summary.json is rewritten after each notebook, so results survive a later failure."""
    t0 = time.perf_counter()
    with RunLog(run_path / LOG_NAME, echo=verbose) as log:
        for i, nb in enumerate(notebooks, 1):
            progress = Progress(i, len(notebooks), nb.stem, animate)
            log.section(f"[{i}/{len(notebooks)}] {nb.stem}")
            progress.start()
            try:
                status = execute(nb, run_path, nb_params[nb], log, progress)
            except BaseException:  # Ctrl-C: stop the live line before the traceback
                progress.finish(f"[{i}/{len(notebooks)}] {nb.stem}: interrupted")
                raise
            progress.finish(result_line(i, len(notebooks), status))
            summary["notebooks"].append(status)
            add_measured_hardware(summary["machine"], summary["units"], nb.stem,
                                  status["recorded"])
            summary["seconds"] = round(time.perf_counter() - t0, 2)
            (run_path / "summary.json").write_text(json.dumps(summary, indent=1, default=str))


def device_line(preset: str, settings) -> str:
    """What the run runs, and where: said first, so that on a GPU machine the default preset's
    CPU (it is calibrated there) is no surprise."""
    where = "the GPU" if settings.device == "cuda" else "the CPU"
    line = f"preset {preset}: {settings.arch.name} ({settings.dtype}) on {where}"
    if settings.device == "cpu" and shutil.which("nvidia-smi"):
        line += "; this machine has an NVIDIA GPU: --preset gpu runs the chapters on it"
    return line


def run(preset: str = DEFAULT_PRESET, names: list[str] = (), params: dict | None = None,
        out: Path | None = None, progress: bool = True,
        verbose: bool = False) -> tuple[int, Path | None]:
    """Run the notebooks; returns (exit status, run folder). `progress`: a live line per
    notebook when stdout is a terminal; `verbose`: the kernels' output on the terminal too."""
    params = dict(params or {})
    notebooks = find_notebooks(list(names))
    declared = validate(preset, notebooks, params)
    settings = load(preset, **settings_params(params))
    run_path = new_run_dir(Path(out or Path.cwd() / "runs"), preset)
    os.environ[RUN_DIR_ENV] = str(run_path)
    from kit.measure.device import describe_apart, versions
    units = {}  # the units of the settings' and the machine's numbers, by dotted name
    summary = {"preset": preset, "parameters": params,
               "settings": plain(settings.as_dict(), units, "settings"),
               # never a CUDA context in this process: its kernels measure the card
               "machine": plain(describe_apart(settings.device, kernel_env()), units, "machine"),
               "versions": versions(), "log": LOG_NAME, "notebooks": [], "units": units}
    nb_params = {nb: {"preset": preset, **{k: v for k, v in params.items() if k in declared[nb]}}
                 for nb in notebooks}
    print(device_line(preset, settings))
    animate = progress and not verbose and sys.stdout.isatty()
    run_notebooks(notebooks, run_path, nb_params, summary, animate, verbose)
    print_summary(summary["notebooks"], run_path)
    from kit.pages.report import write_report_safely
    write_report_safely(run_path)  # never changes the exit status
    return (0 if all(s["ok"] for s in summary["notebooks"]) else 1), run_path


def add_cli(sub) -> None:
    """The `run` and `presets` commands of `python -m kit`."""
    p = sub.add_parser("run", help="run notebooks headless with a preset")
    p.add_argument("notebooks", nargs="*", help="paths, stems or numbers such as 01")
    p.add_argument("--preset", default=DEFAULT_PRESET,
                   help=f"one of {known_names(PRESETS_DIR)} (default {DEFAULT_PRESET})")
    p.add_argument("-p", "--param", action="append", default=[], metavar="NAME=VALUE")
    p.add_argument("--out", type=Path, help="where run folders go (default ./runs)")
    p.add_argument("--no-progress", action="store_true",
                   help="plain lines only, never a live line rewritten in place")
    p.add_argument("--verbose", action="store_true",
                   help="the kernels' output and logs on the terminal too (always in "
                   f"<run>/{LOG_NAME})")
    p.set_defaults(func=lambda a: run(a.preset, a.notebooks, parse_params(a.param), a.out,
                                      not a.no_progress, a.verbose)[0])
    p = sub.add_parser("presets", help="list the presets and what they set")
    p.set_defaults(func=lambda a: print_presets())


def print_presets() -> int:
    for name in known_names(PRESETS_DIR):
        print(f"{name}: {json.loads((PRESETS_DIR / f'{name}.json').read_text())}")
    return 0
