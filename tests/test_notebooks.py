"""Every chapter executed headless on cpu-small, through the runner, as a learner would."""
import json

import nbformat
import pytest

from kit.runner import NOTEBOOKS_DIR, find_notebooks, run

CHAPTERS = [p.stem for p in find_notebooks([])]


@pytest.fixture(scope="module")
def cpu_small_run(tmp_path_factory):
    code, folder = run("cpu-small", out=tmp_path_factory.mktemp("runs"), progress=False)
    return code, json.loads((folder / "summary.json").read_text()), folder


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_chapter_runs_headless_and_its_checks_pass(cpu_small_run, chapter):
    _, summary, folder = cpu_small_run
    status = next(s for s in summary["notebooks"] if s["notebook"] == chapter)
    assert status["ok"], status
    assert status["checks_passed"] >= 3 and not status["checks_failed"]
    assert (folder / f"{chapter}.ipynb").is_file()


def test_whole_run_succeeds(cpu_small_run):
    code, summary, _ = cpu_small_run
    assert code == 0 and summary["versions"]["torch"] and summary["machine"]["device"] == "cpu"


def test_chapter_01_records_the_numbers_it_shows(cpu_small_run):
    _, summary, folder = cpu_small_run
    results = json.loads((folder / "01_memory_profiling.json").read_text())["results"]
    for strategy in ("eager", "compiled"):
        assert results[strategy]["peak_activation_bytes"] > 0
    assert len(json.loads((folder / "01_memory_profiling.json").read_text())["figures"]) >= 3


@pytest.mark.parametrize("path", sorted(NOTEBOOKS_DIR.glob("*.ipynb")), ids=lambda p: p.stem)
def test_notebooks_are_stored_clean(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    assert nb.metadata["kernelspec"]["name"] == "python3" and nb.metadata["language_info"]["name"] == "python"
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(not c.outputs and c.execution_count is None for c in code)
    assert "parameters" in code[0].metadata.get("tags", [])
    assert nb.cells[0].cell_type == "markdown" and "Time on `cpu-small`" in nb.cells[0].source
