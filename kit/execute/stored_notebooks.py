"""How a chapter notebook is stored: no outputs and no run state, in nbformat's own layout. A
save from JupyterLab (`python -m kit lab` strips through `pre_save_hook`) of a chapter that was
only run gives back the stored file byte for byte, so running and saving never shows in git."""
from __future__ import annotations

import fnmatch
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


def is_chapter(path: str) -> bool:
    """A chapter's file name at the top of the notebooks folder (not a learner's own copy)."""
    return "/" not in path.strip("/") and fnmatch.fnmatchcase(Path(path).name, CHAPTER_GLOB)


def stripped(nb: dict) -> dict:
    """`nb` (a notebook as JSON) as it is stored: code cells without outputs or counts, cells
    without run metadata, the notebook without widget, papermill or run metadata."""
    nb["metadata"] = dict(METADATA)
    for cell in nb["cells"]:
        cell["metadata"] = {k: v for k, v in cell.get("metadata", {}).items() if k in CELL_METADATA}
        if cell["cell_type"] == "code":
            cell["outputs"], cell["execution_count"] = [], None
    return nb


def pre_save_hook(model: dict, path: str, **_) -> None:
    """jupyter_server's `ContentsManager.pre_save_hook`: a chapter is saved stripped (its
    results are in the run folder); any other notebook as it is."""
    if model.get("type") == "notebook" and is_chapter(path):
        stripped(model["content"])
