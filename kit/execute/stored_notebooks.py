"""How a chapter notebook is stored in git: no outputs and no run state, in nbformat's own layout.

The chapters are stripped when they are committed, not when they are saved: `.gitattributes`
gives `notebooks/*.ipynb` the git filter `kit-notebooks`, whose clean step is this file run as a
script (`python kit/execute/stored_notebooks.py < chapter > stored`). A chapter that was only run
and saved (by any editor) therefore shows nothing in `git status` or `git diff`, and `git add`
stores it clean. Git runs a filter only where it is configured, once per clone: `./setup.sh`
does it (`--git-config`, here); a clone without it (CI's) commits files as they are, and the
tests check that the stored chapters are clean. Standard library only, so that git can run it
with any Python, quickly, in every worktree of the clone.
"""
from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

# The notebook-level metadata every chapter is stored with (the kit's kernel, Python 3.11).
METADATA = {
    "kernelspec": {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"},
    "language_info": {"codemirror_mode": {"name": "ipython", "version": 3}, "file_extension": ".py",
                      "mimetype": "text/x-python", "name": "python", "nbconvert_exporter": "python",
                      "pygments_lexer": "ipython3", "version": "3.11"},
}
CELL_METADATA = ("tags",)  # what a cell keeps: the parameters cell's tag
CHAPTER_GLOB = "[0-9][0-9]_*.ipynb"  # a chapter's file name (`find_notebooks` lists these)
GIT_FILTER = "kit-notebooks"  # the filter's name in .gitattributes and in the clone's config
SPLIT_MIMES = ("application/javascript", "image/svg+xml")  # split into lines, as text/* is


def stripped(nb: dict) -> dict:
    """`nb` (a notebook as JSON) as it is stored: code cells without outputs or counts, cells
    without run metadata, the notebook without widget, papermill or run metadata."""
    nb["metadata"] = json.loads(json.dumps(METADATA))
    for cell in nb["cells"]:
        cell["metadata"] = {k: v for k, v in cell.get("metadata", {}).items() if k in CELL_METADATA}
        if cell["cell_type"] == "code":
            cell["outputs"], cell["execution_count"] = [], None
    return nb


def notebook_text(nb: dict) -> str:
    """`nb` written as nbformat writes it (jupyter_server's save, `nbformat.write`): sources and
    text attachments as lists of lines, keys sorted, one space of indent, a final newline."""
    for cell in nb["cells"]:
        if isinstance(cell.get("source"), str):
            cell["source"] = cell["source"].splitlines(True)
        for bundle in cell.get("attachments", {}).values():
            for key, value in bundle.items():
                if isinstance(value, str) and (key.startswith("text/") or key in SPLIT_MIMES):
                    bundle[key] = value.splitlines(True)
    return json.dumps(nb, indent=1, sort_keys=True, separators=(",", ": "),
                      ensure_ascii=False) + "\n"


def clean(data: bytes) -> bytes:
    """The filter's clean step: a notebook's bytes as stored. Anything that is not a notebook
    passes unchanged: git must never lose what it is given."""
    try:
        nb = json.loads(data)
        return notebook_text(stripped(nb)).encode()
    except (ValueError, KeyError, TypeError, AttributeError):
        return data


def git_config(repo: Path, python: str = sys.executable) -> str:
    """Configures the filter in `repo`'s clone (all its worktrees share it); again is harmless.
    The script's path is relative: git runs filters at the top of the worktree at hand."""
    command = f"{shlex.quote(python)} kit/execute/stored_notebooks.py"
    subprocess.run(["git", "config", f"filter.{GIT_FILTER}.clean", command], cwd=repo, check=True)
    return command


if __name__ == "__main__":
    if sys.argv[1:] == ["--git-config"]:
        print(f"git filter {GIT_FILTER}: {git_config(Path.cwd())}")
    else:
        sys.stdout.buffer.write(clean(sys.stdin.buffer.read()))
