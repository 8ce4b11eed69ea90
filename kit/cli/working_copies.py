"""A participant's own copies of the chapters, the folder `python -m kit lab` serves.

Workshops keep the originals pristine and hand each participant a working copy (nbgitpuller,
JupyterHub's per-user folders): here `runs/lab/` (git ignores `runs/`). A chapter is copied
there only when no copy is there yet, so a participant's edits and outputs, saved as JupyterLab
saves them, survive every restart of `kit lab`. Starting over (`kit lab --fresh [02 ...]`) sets
the copies aside in `runs/lab/earlier-<time>-copies/` and copies the originals again. The
originals in `notebooks/` are never written to; git keeps them clean at commit time
(`kit.execute.stored_notebooks`).
"""
from __future__ import annotations

import hashlib
import json
import platform
from dataclasses import dataclass, field
from pathlib import Path

from kit.execute.notebooks import NOTEBOOKS_DIR, find_notebooks
from kit.execute.stored_notebooks import notebook_text
from kit.results import RUNS_DIR, new_run_dir

WORK_DIR = RUNS_DIR / "lab"
ORIGINS = ".kit-originals.json"  # each copy's original, by its sha256 when copied


@dataclass
class WorkingCopies:
    """What `make_copies` did in `folder`: the chapters copied now, those kept as the
    participant left them, the kept ones whose original has changed since, and where
    the copies a fresh start replaced went."""
    folder: Path
    copied: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)
    outdated: list[str] = field(default_factory=list)
    set_aside: Path | None = None


def working_copy(original: Path) -> str:
    """The original chapter as a participant gets it: the same cells, its language_info at the
    Python the kernel runs (the stored "3.11" differs from the kernel's "3.11.7", which
    JupyterLab would write into the notebook on opening it and mark the tab unsaved)."""
    nb = json.loads(original.read_text())
    nb["metadata"].setdefault("language_info", {})["version"] = platform.python_version()
    return notebook_text(nb)


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def make_copies(folder: Path = WORK_DIR, fresh: list[str] | None = None) -> WorkingCopies:
    """Copies into `folder` each chapter that has no copy there. The `fresh` ones (numbers or
    names, as `kit run` takes them; an empty list: all) are copied again, their copies set
    aside first."""
    chapters = find_notebooks([])
    restart = set() if fresh is None else {p.name for p in find_notebooks(fresh)}
    folder.mkdir(parents=True, exist_ok=True)
    done = WorkingCopies(folder)
    origins_file = folder / ORIGINS
    origins = json.loads(origins_file.read_text()) if origins_file.is_file() else {}
    for original in chapters:
        copy = folder / original.name
        if copy.exists() and original.name in restart:
            done.set_aside = done.set_aside or new_run_dir(folder, "copies", "earlier-")
            copy.rename(done.set_aside / copy.name)
        if copy.exists():
            done.kept.append(original.name)
            if origins.get(original.name, digest(original)) != digest(original):
                done.outdated.append(original.name)
            continue
        copy.write_text(working_copy(original))
        origins[original.name] = digest(original)
        done.copied.append(original.name)
    origins_file.write_text(json.dumps(origins, indent=1, sort_keys=True) + "\n")
    return done


def where_your_work_is(done: WorkingCopies) -> list[str]:
    """What a participant reads when `kit lab` starts: where their work is, how to start over."""
    lines = [f"Your copies of the chapters are in {done.folder}: save freely, outputs included; "
             f"the originals in {NOTEBOOKS_DIR} stay as they are."]
    if done.set_aside:
        lines.append(f"Your earlier copies are in {done.set_aside}.")
    if done.copied and done.kept:
        lines.append(f"Copied now: {', '.join(done.copied)}; the others are as you left them.")
    for name in done.outdated:
        lines.append(f"{name} has changed in {NOTEBOOKS_DIR.name}/ since you copied it: "
                     f"`kit lab --fresh {name[:2]}` gives you the new one (yours set aside).")
    lines.append("To start over: `python -m kit lab --fresh` (every chapter) or "
                 "`--fresh 02` (one); your copies are set aside, not deleted.")
    return lines
