"""Recorded results and checks: what every chapter leaves behind for `python -m kit run` to
collect, and the run folders they go to (named here, and only here).

A notebook makes one `Recorder`, records numbers and checks as it goes (each written to disk at
once, so results survive a failure later in the notebook) and calls `finish()` last, which
shows the checks and raises if one failed, so papermill marks the notebook as failed.
"""
from __future__ import annotations

import datetime as dt
import json
import math
import os
from pathlib import Path

from kit.config import DATA
from kit.units import Quantity

RUN_DIR_ENV = "KIT_RUN_DIR"
RUNS_DIR = DATA.parent / "runs"  # the checkout's: JupyterLab's runs and the benchmarks' files
BENCH_DIR = RUNS_DIR / "bench"


def now_stamp() -> str:
    """The time in a run folder's name: 20261203-211500."""
    return dt.datetime.now().strftime("%Y%m%d-%H%M%S")


def new_run_dir(root: Path, preset: str, prefix: str = "") -> Path:
    """A new folder `<prefix><stamp>-<preset>` under `root` (a number added if taken)."""
    stamp = now_stamp()
    for i in range(1000):
        path = root / (f"{prefix}{stamp}-{preset}" + (f"-{i}" if i else ""))
        try:
            path.mkdir(parents=True)
            return path
        except FileExistsError:
            continue
    raise RuntimeError(f"could not create a new run folder under {root}")


def bench_output(kind: str, preset: str, suffix: str = "") -> Path:
    """Where a benchmark writes by default: runs/bench/<kind>-<stamp>-<preset><suffix>."""
    return BENCH_DIR / f"{kind}-{now_stamp()}-{preset}{suffix}"


def run_dir() -> Path:
    """The run folder `python -m kit run` set (KIT_RUN_DIR), else runs/interactive for JupyterLab."""
    path = Path(os.environ.get(RUN_DIR_ENV) or RUNS_DIR / "interactive")
    path.mkdir(parents=True, exist_ok=True)
    return path


def plain(value, units: dict | None = None, path: str = ""):
    """Numbers from torch or numpy as plain JSON values. A typed number (`kit.units.Quantity`)
    is written plain and, when `units` is given, its unit goes there under its dotted `path`
    (a list's numbers under the list's path)."""
    if isinstance(value, Quantity) and units is not None:
        units[path] = value.unit
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)):
        return int(value) if isinstance(value, int) else float(value)
    if isinstance(value, dict):
        return {str(k): plain(v, units, f"{path}.{k}" if path else str(k))
                for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v, units, path) for v in value]
    return value


# Result names renamed since older runs were recorded: vLLM #7796 was called "the seed" in them,
# a word the kit keeps for the random seed (`seed_kv_ratio` became `pr_kv_ratio`, and so on).
RENAMED_PREFIXES = {"seed_": "pr_"}


def current_name(name: str) -> str:
    """A recorded result's name as the kit writes it today; each part of a dotted name apart."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        old = next((o for o in RENAMED_PREFIXES if part.startswith(o)), None)
        if old is not None:
            parts[i] = RENAMED_PREFIXES[old] + part[len(old):]
    return ".".join(parts)


def current_names(results):
    """Recorded results (nested dicts and lists) with every name as today's (`current_name`),
    so that the report and `kit compare` read older runs beside newer ones."""
    if isinstance(results, dict):
        return {current_name(str(k)): current_names(v) for k, v in results.items()}
    if isinstance(results, list):
        return [current_names(v) for v in results]
    return results


class CheckFailed(AssertionError):
    pass


class Recorder:
    def __init__(self, chapter: str, settings=None):
        self.chapter = chapter
        self.path = run_dir() / f"{chapter}.json"
        self.data = {"chapter": chapter, "settings": plain(settings.as_dict()) if settings else {},
                     "results": {}, "units": {}, "checks": [], "figures": []}
        self._save()

    @property
    def folder(self) -> Path:
        """The run folder this record (and the chapter's other files) goes to."""
        return self.path.parent

    def recorded(self, chapter: str) -> dict | None:
        """What another chapter recorded in this run folder (its JSON), or None."""
        path = self.folder / f"{chapter}.json"
        return json.loads(path.read_text()) if path.is_file() else None

    def _save(self):
        self.path.write_text(json.dumps(self.data, indent=1, default=str))

    def record(self, **results):
        """Record named results (numbers, strings, small dicts). Each number should be typed
        (`kit.units`: `Bytes(n)`, `Seconds.of(...)`), so the pages show it in its unit; its
        unit is recorded under `units` by its dotted name."""
        def stale(key):  # the unit of a result recorded again, or of a part of it
            return any(key == name or key.startswith(name + ".") for name in results)
        self.data["units"] = {k: u for k, u in self.data["units"].items() if not stale(k)}
        self.data["results"].update(plain(results, self.data["units"]))
        self._save()

    def check(self, name: str, ok, detail: str = "") -> None:
        """Record a check; it fails the notebook at `finish()`, not here, so all are seen. It
        returns nothing, so that a cell ending with a check shows its PASS line and no stray
        `True` beneath it."""
        ok = bool(ok)
        self.data["checks"].append({"name": name, "ok": ok, "detail": detail})
        self._save()
        print(f"{'PASS' if ok else 'FAIL'}  {name}" + (f"  ({detail})" if detail else ""))

    def figure(self, name: str, fig):
        """Keep the figure's JSON with the run, and return it for display."""
        folder = self.path.parent / "figures"
        folder.mkdir(exist_ok=True)
        path = folder / f"{self.chapter}--{name}.json"
        path.write_text(fig.to_json())
        self.data["figures"].append(path.name)
        self._save()
        return fig

    def failed(self) -> list[dict]:
        return [c for c in self.data["checks"] if not c["ok"]]

    def finish(self):
        checks = self.data["checks"]
        print(f"{self.chapter}: {len(checks) - len(self.failed())}/{len(checks)} checks passed; "
              f"results in {self.path}")
        if not checks:
            raise CheckFailed(f"{self.chapter} recorded no checks")
        if self.failed():
            raise CheckFailed("failed: " + "; ".join(c["name"] for c in self.failed()))
