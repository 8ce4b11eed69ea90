"""`python -m kit sweep`: every point of a grid as an ordinary run, on Ray, on this machine or a
cluster, gathered under one sweep folder with `sweep.json` and `sweep.html`.

    python -m kit sweep [--preset NAME] [NOTEBOOK ...] --grid NAME=V1,V2,... [--grid ...]
                        [-p NAME=VALUE ...] [--address ADDRESS] [--parallel N] [--out DIR]
                        [--resume FOLDER] [--yes] [--max-points N] [--no-progress]

Each point is a Ray task: on whichever node Ray picks it runs `python -m kit run` on the
notebooks the driver sent (their text travels with the task), packs the run folder and returns
it; the driver unpacks it under `runs/sweep-<stamp>-<preset>/<NN>-<grid values>/`. A cluster
needs the kit set up on every node (the same commit), no shared filesystem. Without `--address`
a local Ray instance is started and stopped. At most `--parallel` points run at once (default 1:
points sharing a machine disturb each other's timings); on GPU nodes each point takes one GPU.
A failed point is recorded with its error and the others go on; `--resume FOLDER` runs again
the points that failed or are missing. `sweep.json` is rewritten after every point.
"""
from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from kit.config import DEFAULT_PRESET, PRESETS_DIR, known_names, read_preset
from kit.errors import ConfigError
from kit.execute.notebooks import describe_failure, find_notebooks, kernel_env, parse_params
from kit.execute.progress import CLEAR_LINE, fit
from kit.pages.html import flatten, is_number
from kit.pages.sweep_page import SWEEP_FILE, load_sweep, write_page
from kit.results import new_run_dir
from kit.sweep import grid as grids

POINT_LOG = "sweep-point.log"  # the point's `python -m kit run` output, in its run folder


# ---------------------------------------------------------------- on the worker: one point

def node_info() -> dict:
    import socket

    import ray
    return {"node_id": ray.get_runtime_context().get_node_id(),
            "ip": ray.util.get_node_ip_address(), "hostname": socket.gethostname(),
            "niceness": os.nice(0)}


def point_env(omp_num_threads: str | None) -> dict:
    """The point's environment: the worker's, with this kit first on PYTHONPATH and the thread
    count a plain `python -m kit run` would use (Ray sets OMP_NUM_THREADS to the task's one CPU;
    the driver's own setting, if any, is kept)."""
    env = kernel_env()
    env.pop("OMP_NUM_THREADS", None)
    if omp_num_threads:
        env["OMP_NUM_THREADS"] = omp_num_threads
    return env


def pack(folder: Path) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        tar.add(folder, arcname=".")
    return buffer.getvalue()


def run_point(preset: str, notebooks: dict[str, str], params: dict,
              omp_num_threads: str | None) -> dict:
    """A Ray task: run the notebooks (name -> text) with `params` as `python -m kit run` does,
    in a fresh folder; return the exit code, the seconds, the node and the packed run folder."""
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="kit-sweep-") as tmp:
        tmp = Path(tmp)
        (tmp / "notebooks").mkdir()
        paths = []
        for name, text in notebooks.items():
            (tmp / "notebooks" / name).write_text(text)
            paths.append(str(tmp / "notebooks" / name))
        command = [sys.executable, "-m", "kit", "run", "--no-progress", "--preset", preset,
                   "--out", str(tmp / "runs"), *paths,
                   *(arg for k, v in params.items() for arg in ("-p", f"{k}={v!r}"))]
        done = subprocess.run(command, cwd=tmp, env=point_env(omp_num_threads),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        folders = sorted((tmp / "runs").glob("*")) if (tmp / "runs").is_dir() else []
        archive = None
        if folders:  # the log names the run folder as "." (this temporary one is gone after)
            (folders[0] / POINT_LOG).write_text(done.stdout.replace(str(folders[0]), "."))
            archive = pack(folders[0])
    return {"exit_code": done.returncode, "output": done.stdout[-4000:], "archive": archive,
            "started": started, "ended": time.time(), "node": node_info()}


# ---------------------------------------------------------------- on the driver

def plan(preset: str, names: list[str], grid_pairs: list[str], param_pairs: list[str],
         max_points: int, yes: bool, remote: bool) -> dict:
    """The sweep as sweep.json holds it, every point pending; refuses a bad grid (ConfigError)
    before anything starts."""
    read_preset(preset)  # an unknown preset refused first, as `python -m kit run`'s validation does
    notebooks = find_notebooks(names)
    grid, fixed = grids.parse_grid(grid_pairs), parse_params(param_pairs)
    points = grids.check(preset, notebooks, grid, fixed, max_points, yes, remote)
    return {"preset": preset, "notebooks": [str(nb) for nb in notebooks], "grid": grid,
            "fixed": fixed, "runs": [],
            "points": [{"index": i, "name": grids.point_name(i, p), "parameters": p,
                        "status": "pending", "error": None, "seconds": None, "attempts": 0}
                       for i, p in enumerate(points, 1)]}


def save(folder: Path, sweep: dict) -> None:
    tmp = folder / (SWEEP_FILE + ".tmp")
    tmp.write_text(json.dumps(sweep, indent=1, default=str))
    tmp.replace(folder / SWEEP_FILE)


def numbers_of(summary: dict) -> tuple[dict, dict]:
    """Every number the point's chapters recorded, as `<chapter>.<dotted name>`, and their
    units under the same names."""
    out, units = {}, {}
    for nb in summary.get("notebooks", []):
        recorded = nb.get("recorded") or {}
        for name, value in flatten(recorded.get("results", {})).items():
            if is_number(value):
                out[f"{nb['notebook']}.{name}"] = value
                unit = recorded.get("units", {}).get(name)
                if unit:
                    units[f"{nb['notebook']}.{name}"] = unit
    return out, units


def point_error(result: dict, summary: dict | None) -> str | None:
    if result["exit_code"] == 0:
        return None
    if summary and summary.get("notebooks"):
        failed = [f"{s['notebook']}: {describe_failure(s)}"
                  for s in summary["notebooks"] if not s["ok"]]
        if failed:
            return " | ".join(failed)
    lines = [line for line in result["output"].splitlines() if line.strip()]
    tail = lines[-1] if lines else "no output"
    return f"exit code {result['exit_code']}: {tail}"


def record(folder: Path, point: dict, result: dict) -> None:
    """Unpack a finished point's run folder under the sweep folder and fill in its entry."""
    target = folder / point["name"]
    if target.exists():
        shutil.rmtree(target)
    summary = None
    if result.get("archive"):
        target.mkdir()
        with tarfile.open(fileobj=io.BytesIO(result["archive"]), mode="r:gz") as tar:
            tar.extractall(target, filter="data")
        if (target / "summary.json").is_file():
            summary = json.loads((target / "summary.json").read_text())
    numbers, units = numbers_of(summary or {})
    point.update(
        status="ok" if result["exit_code"] == 0 else "failed",
        error=point_error(result, summary),
        seconds=round(result["ended"] - result["started"], 1),
        started=result["started"], ended=result["ended"], node=result["node"],
        folder=point["name"] if target.is_dir() else None,
        notebooks=[{"notebook": s["notebook"], "ok": s["ok"], "seconds": s["seconds"],
                    "checks_passed": s["checks_passed"], "checks_failed": s["checks_failed"]}
                   for s in (summary or {}).get("notebooks", [])],
        results=numbers, units=units)


def record_crash(point: dict, error: BaseException, started: float) -> None:
    """A task that never returned (its worker died: out of memory, killed)."""
    point.update(status="failed", error=f"{type(error).__name__}: {str(error).strip()[:2000]}",
                 seconds=round(time.time() - started, 1), folder=None, results={},
                 notebooks=[], node=None, started=started, ended=time.time())


def start_ray(address: str | None, parallel: int):
    """Join the cluster at `address`, or start a local instance of our own (even where a
    cluster runs on this machine) with room for `parallel` points; returns the ray module."""
    import logging
    try:
        import ray
    except ImportError:
        raise ConfigError("Ray is not installed: run ./setup.sh (ray is one of the kit's "
                          "dependencies)") from None
    quiet = {"log_to_driver": False, "logging_level": logging.ERROR}
    try:
        if address:
            ray.init(address=address, **quiet)
        else:  # Ray lowers its workers' priority (nice 15) unless told; a point runs as a run
            os.environ.setdefault("RAY_worker_niceness", "0")
            ray.init(address="local", num_cpus=max(parallel, 1), include_dashboard=False, **quiet)
    except (ConnectionError, RuntimeError, ValueError) as e:
        where = f"the Ray cluster at {address}" if address else "a local Ray instance"
        raise ConfigError(f"could not start or join {where}: {e}") from None
    return ray


def live(sweep: dict, running: dict, t0: float) -> str:
    points = sweep["points"]
    done = sum(p["status"] == "ok" for p in points)
    failed = sum(p["status"] == "failed" for p in points)
    names = ", ".join(p["name"] for p in running.values())
    return (f"sweep: {done + failed}/{len(points)} done, {len(running)} running, {failed} failed"
            f" · {time.time() - t0:.0f} s" + (f" · {names}" if names else ""))


def point_line(point: dict, total: int) -> str:
    node = (point.get("node") or {}).get("node_id", "?")[:8]
    status = "ok" if point["status"] == "ok" else "FAILED"
    line = (f"[{point['index']}/{total}] {point['name']}: {status} in {point['seconds']:.1f} s "
            f"on node {node}")
    return line + (f" · {point['error']}" if point.get("error") else "")


def run_points(folder: Path, sweep: dict, todo: list[dict], address: str | None, parallel: int,
            animate: bool) -> None:
    """Run the points of `todo` as Ray tasks, `parallel` at once; each finished point is
    unpacked, recorded in sweep.json and printed."""
    notebooks = {Path(p).name: Path(p).read_text() for p in sweep["notebooks"]}
    started = time.time()  # the wall time counts Ray's start and stop
    ray = start_ray(address, parallel)
    gpus = ray.cluster_resources().get("GPU", 0)
    task = ray.remote(run_point).options(num_cpus=1, num_gpus=1 if gpus else 0, max_retries=0)
    sweep["runs"].append({"address": address or "local", "parallel": parallel,
                          "nodes": len(ray.nodes()), "gpus": gpus, "started": started,
                          "ended": None})
    save(folder, sweep)
    omp = os.environ.get("OMP_NUM_THREADS")
    queue, running, t0 = list(todo), {}, time.time()
    try:
        while queue or running:
            while queue and len(running) < parallel:
                point = queue.pop(0)
                point["attempts"] = point.get("attempts", 0) + 1
                point["submitted"] = time.time()
                params = {**sweep["fixed"], **point["parameters"]}
                running[task.remote(sweep["preset"], notebooks, params, omp)] = point
            ready, _ = ray.wait(list(running), num_returns=1, timeout=1.0)
            for ref in ready:
                point = running.pop(ref)
                try:
                    record(folder, point, ray.get(ref))
                except ray.exceptions.RayError as e:  # the worker died (out of memory, killed)
                    record_crash(point, e, point["submitted"])
                save(folder, sweep)
                print((CLEAR_LINE if animate else "") + point_line(point, len(sweep["points"])),
                      flush=True)
            if animate:
                width = shutil.get_terminal_size().columns - 1
                sys.stdout.write(CLEAR_LINE + fit(live(sweep, running, t0), width))
                sys.stdout.flush()
    finally:
        if animate:
            sys.stdout.write(CLEAR_LINE)
        for ref in running:  # interrupted: the points still running stay pending
            ray.cancel(ref, force=True)
        ray.shutdown()  # stops the local instance; only disconnects from a cluster
        sweep["runs"][-1]["ended"] = time.time()
        save(folder, sweep)


def sweep(preset: str = DEFAULT_PRESET, names: list[str] = (), grid_pairs: list[str] = (),
          param_pairs: list[str] = (), address: str | None = None, parallel: int = 1,
          out: Path | None = None, resume: Path | None = None, yes: bool = False,
          max_points: int = grids.MAX_POINTS, progress: bool = True) -> tuple[int, Path]:
    """Run (or resume) a sweep; returns (exit status, sweep folder)."""
    if parallel < 1:
        raise ConfigError(f"--parallel {parallel}: give 1 or more")
    if resume:
        if names or grid_pairs or param_pairs:
            raise ConfigError("--resume takes the notebooks, grid and parameters from "
                              f"{Path(resume) / SWEEP_FILE}; give no others")
        folder = Path(resume)
        sweep_ = load_sweep(folder)
    else:
        sweep_ = plan(preset, list(names), list(grid_pairs), list(param_pairs), max_points, yes,
                      remote=bool(address))
        folder = new_run_dir(Path(out or Path.cwd() / "runs"), preset, prefix="sweep-")
        save(folder, sweep_)
    todo = [p for p in sweep_["points"]
            if p["status"] != "ok" or not (folder / (p.get("folder") or p["name"])).is_dir()]
    print(f"sweep: {len(todo)} of {len(sweep_['points'])} points to run, {parallel} at once, "
          f"on {address or 'a local Ray instance'}; folder {folder}", flush=True)
    try:
        if todo:
            run_points(folder, sweep_, todo, address, parallel, progress and sys.stdout.isatty())
    except KeyboardInterrupt:
        print(f"\nsweep: interrupted; run the rest with python -m kit sweep --resume {folder}")
        write_page(folder)
        return 130, folder
    page = write_page(folder)
    failed = [p for p in sweep_["points"] if p["status"] != "ok"]
    print(f"\nsweep: {len(sweep_['points']) - len(failed)}/{len(sweep_['points'])} points ok"
          + (f"; resume the rest with python -m kit sweep --resume {folder}" if failed else ""))
    print(f"sweep folder: {folder}\nsweep page: {page}")
    return (0 if not failed else 1), folder


def add_cli(sub) -> None:
    """The `sweep` command of `python -m kit`."""
    p = sub.add_parser("sweep", help="run a grid of parameters (each point a run) on Ray")
    p.add_argument("notebooks", nargs="*", help="paths, stems or numbers such as 02 (default all)")
    p.add_argument("--preset", default=DEFAULT_PRESET,
                   help=f"one of {known_names(PRESETS_DIR)} (default {DEFAULT_PRESET})")
    p.add_argument("--grid", action="append", default=[], metavar="NAME=V1,V2,...",
                   help="a swept parameter and its values (repeat: the points are the product)")
    p.add_argument("-p", "--param", action="append", default=[], metavar="NAME=VALUE",
                   help="a parameter fixed at every point")
    p.add_argument("--address", help="a running Ray cluster to join (default: start a local one)")
    p.add_argument("--parallel", type=int, default=1,
                   help="points at once (default 1: timings of points sharing a machine disturb "
                   "each other)")
    p.add_argument("--out", type=Path, help="where the sweep folder goes (default ./runs)")
    p.add_argument("--resume", type=Path, metavar="FOLDER",
                   help="run again the points of FOLDER's sweep that failed or are missing")
    p.add_argument("--yes", action="store_true", help="run a grid larger than --max-points")
    p.add_argument("--max-points", type=int, default=grids.MAX_POINTS,
                   help=f"refuse larger grids without --yes (default {grids.MAX_POINTS})")
    p.add_argument("--no-progress", action="store_true", help="plain lines only")
    p.set_defaults(func=lambda a: sweep(a.preset, a.notebooks, a.grid, a.param, a.address,
                                        a.parallel, a.out, a.resume, a.yes, a.max_points,
                                        not a.no_progress)[0])
