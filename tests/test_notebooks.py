"""Every chapter executed headless on cpu-small, through `python -m kit run`, as a learner would
(the run is the session fixture `cpu_small_run` of conftest.py); notebooks stored workshop-ready."""
import ast
import json
import re
import shutil
import subprocess

import nbformat
import pytest

from kit.config import PARAMETERS
from kit.execute.notebooks import NOTEBOOKS_DIR, find_notebooks

CHAPTERS = [p.stem for p in find_notebooks([])]


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_chapter_runs_headless_and_its_checks_pass(cpu_small_run, chapter):
    _, summary, folder = cpu_small_run
    status = next(s for s in summary["notebooks"] if s["notebook"] == chapter)
    assert status["ok"], status
    assert status["checks_passed"] >= 3 and not status["checks_failed"]
    assert (folder / f"{chapter}.ipynb").is_file()


def test_no_cell_prints_to_stderr(cpu_small_run):
    """What a learner sees in JupyterLab: no cell has a stderr output (Lab draws each as an
    error-coloured box), neither C-level chatter such as the profiler's `USDT:` lines nor a
    library's warnings."""
    _, _, folder = cpu_small_run
    found = [(chapter, i, "".join(o["text"])[:200])
             for chapter in CHAPTERS
             for i, cell in enumerate(nbformat.read(folder / f"{chapter}.ipynb", 4).cells)
             for o in cell.get("outputs", []) if o.get("name") == "stderr"]
    assert not found, found


# A library's log record as its handlers print it: a level, then the file and line that logged
# it (vLLM's "INFO 12-05 02:28:09 [api_utils.py:286] ..."), a traceback it logged, or its
# progress bar (tqdm's "45%|####", vLLM's "0% Completed | 0/1").
LOG_LINE = re.compile(r"\b(DEBUG|INFO|WARNING|ERROR|CRITICAL)\b.*\[[\w./-]+\.py:\d+\]"
                      r"|Traceback \(most recent call last\)|\d+%\s*(Completed\s*)?\|")
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def output_text(output) -> str:
    text = output.get("text") or output.get("data", {}).get("text/plain", "")
    return ANSI.sub("", "".join(text))


def test_no_cell_shows_a_librarys_log(cpu_small_run):
    """Nor on stdout or in a display: a library's log lines (vLLM's start-up, seventy lines
    for each engine) and progress bars belong in the run's logs, not between the chapter's own
    lines."""
    _, _, folder = cpu_small_run
    found = [(chapter, i, line[:200])
             for chapter in CHAPTERS
             for i, cell in enumerate(nbformat.read(folder / f"{chapter}.ipynb", 4).cells)
             for o in cell.get("outputs", [])
             for line in output_text(o).splitlines() if LOG_LINE.search(line)]
    assert not found, found[:5]


def test_whole_run_succeeds(cpu_small_run):
    code, summary, _ = cpu_small_run
    assert code == 0 and summary["versions"]["torch"] and summary["machine"]["device"] == "cpu"


def test_chapter_01_records_the_numbers_it_shows(cpu_small_run):
    _, summary, folder = cpu_small_run
    results = json.loads((folder / "01_memory_profiling.json").read_text())["results"]
    for strategy in ("eager", "compiled"):
        assert results[strategy]["peak_activation_bytes"] > 0
    assert len(json.loads((folder / "01_memory_profiling.json").read_text())["figures"]) >= 3
    # the PR's lesson on the default preset: its device is as tight as the PR's GPU
    assert results["kv_ratio_compiled_over_eager"] >= 1.2
    assert results["kv_ratio_compiled_over_eager"] == pytest.approx(
        1 + results["eager_extra_over_eager_kv"])


def test_chapter_00_records_the_isa_and_a_matmul_per_dtype(cpu_small_run):
    _, _, folder = cpu_small_run
    results = json.loads((folder / "00_setup_check.json").read_text())["results"]
    assert set(results["matmul"]) == {"float32", "bfloat16", "float16"}
    assert all(m["rate"] > 0 and m["repeats"] >= 3 for m in results["matmul"].values())
    assert results["cpu_isa"]["pytorch_kernels"] and results["copy"]["rate"] > 0
    assert set(results["dtype_speeds"]) == {"bfloat16", "float16"}


@pytest.mark.parametrize("path", sorted(NOTEBOOKS_DIR.glob("*.ipynb")), ids=lambda p: p.stem)
def test_notebooks_are_stored_clean_and_workshop_ready(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    assert nb.metadata["kernelspec"]["name"] == "python3" and nb.metadata["language_info"]["name"] == "python"
    # stored without outputs, nor what a run or JupyterLab leaves behind
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(not c.outputs and c.execution_count is None for c in code)
    assert not {"widgets", "papermill"} & set(nb.metadata), "saved with run or widget state"
    assert all("execution" not in c.metadata and "papermill" not in c.metadata for c in nb.cells)
    assert "parameters" in code[0].metadata.get("tags", [])
    # opens with what it teaches and how long it takes ...
    first = nb.cells[0]
    assert first.cell_type == "markdown" and "Time on `cpu-small`" in first.source
    assert "teaches" in first.source.lower()
    # ... and ends with things to try (a list of them), then the recorder's finish
    markdown = [c for c in nb.cells if c.cell_type == "markdown"]
    to_try = markdown[-1].source.split("Things to try", 1)
    assert len(to_try) == 2 and to_try[1].count("\n- ") >= 2, "the last text lacks 'Things to try'"
    assert nb.cells[-1].cell_type == "code" and nb.cells[-1].source.strip() == "rec.finish()"


MAX_CELL_LINES = 12


@pytest.mark.parametrize("path", sorted(NOTEBOOKS_DIR.glob("*.ipynb")), ids=lambda p: p.stem)
def test_notebooks_are_thin(path):
    """Narrative, parameters, calls and checks: the parameters cell holds plain literals; where
    they are settings they reach them through `kit.notebook_settings` (never listed again,
    never rebound; chapter 06's are a log and its model, not settings), and no other code cell
    runs over MAX_CELL_LINES lines (the logic lives in kit/)."""
    code = [c for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code"]
    params, cells = code[0], code[1:]
    names = set()
    for statement in ast.parse(params.source).body:
        assert isinstance(statement, ast.Assign), ast.unparse(statement)
        ast.literal_eval(statement.value)  # raises unless a plain literal
        names |= {t.id for t in statement.targets}
    if names & set(PARAMETERS):
        assert "settings = kit.notebook_settings(globals())" in cells[0].source
    assert not any("kit.load(" in c.source for c in cells)
    # no later cell rebinds a parameter, so running the settings cell again reads the same
    rebound = {node.id for c in cells for node in ast.walk(ast.parse(c.source))
               if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store)
               and node.id in {*PARAMETERS, "preset"}}
    assert not rebound, rebound
    long = {i: len(c.source.splitlines()) for i, c in enumerate(cells, 2)
            if len(c.source.splitlines()) > MAX_CELL_LINES}
    assert not long, f"code cells (number: lines) over {MAX_CELL_LINES} lines: {long}"


@pytest.mark.parametrize("path", sorted(NOTEBOOKS_DIR.glob("*.ipynb")), ids=lambda p: p.stem)
def test_every_figure_a_cell_makes_is_shown(path):
    """A cell shows its last expression and what it hands to `display(...)`: a `rec.figure(...)`
    (or any `*figure*` call) elsewhere, in a statement before the last or inside an `if` or a
    loop, is recorded but never drawn, in JupyterLab or in the headless notebook."""
    hidden = []
    for i, cell in enumerate(nbformat.read(path, as_version=4).cells):
        body = ast.parse(cell.source).body if cell.cell_type == "code" else []
        shown = {id(n) for s in body[-1:] if isinstance(s, ast.Expr) for n in ast.walk(s)}
        shown |= {id(n) for call in ast.walk(ast.Module(body, [])) if isinstance(call, ast.Call)
                  and ast.unparse(call.func) == "display" for n in ast.walk(call)}
        hidden += [f"cell {i}: {ast.unparse(n)[:60]}" for n in ast.walk(ast.Module(body, []))
                   if isinstance(n, ast.Call) and "figure" in ast.unparse(n.func)
                   and id(n) not in shown]
    assert not hidden, hidden


def test_a_bad_parameter_reads_as_one_line_and_still_stops_the_run():
    """In a kernel, a `ConfigError` from the settings cell is its one line (no traceback
    through kit/config), the cell still fails (a headless run stops there), and an unexpected
    error keeps its traceback."""
    from nbclient import NotebookClient
    nb = nbformat.v4.new_notebook(metadata={"kernelspec": {"name": "python3",
                                                           "display_name": "Python 3"}})
    nb.cells = [nbformat.v4.new_code_cell("block_size = 17\nimport kit\n"
                                          "settings = kit.notebook_settings(globals())"),
                nbformat.v4.new_code_cell("1 / 0")]
    NotebookClient(nb, kernel_name="python3", allow_errors=True,  # run in this checkout
                   resources={"metadata": {"path": str(NOTEBOOKS_DIR.parent)}}).execute()
    [refusal], [other] = nb.cells[0].outputs, nb.cells[1].outputs
    assert refusal.output_type == "error" and refusal.ename == "ConfigError"
    assert refusal.traceback == [f"ConfigError: {refusal.evalue}"]
    assert "block_size=17 must be a power of two" in refusal.evalue
    assert other.ename == "ZeroDivisionError" and len(other.traceback) > 1


def test_chapter_00_gives_a_verdict(cpu_small_run):
    """The setup check ends in READY (here) and knows what to do for every check it makes."""
    from kit.show.tables import Verdict
    from kit.studies.setup_check import fix_for, readiness
    _, _, folder = cpu_small_run
    recorded = json.loads((folder / "00_setup_check.json").read_text())
    assert recorded["results"]["ready"] is True and recorded["results"]["setup_check_seconds"] > 0
    assert all(fix_for(c["name"]) for c in recorded["checks"]), "a check without a fix"
    executed = nbformat.read(folder / "00_setup_check.ipynb", as_version=4)
    shown = [o["data"]["text/plain"] for c in executed.cells for o in c.get("outputs", [])
             if "READY" in o.get("data", {}).get("text/plain", "")]
    assert shown and shown[0].startswith("READY: all")
    # the same checks with the compile probe failed, as on a machine without a C++ compiler
    failed = [dict(c, ok=not c["name"].startswith("torch.compile")) for c in recorded["checks"]]
    verdict = readiness(failed, 12.0)
    assert not verdict.ready and [n for n, _ in verdict.todo] == ["torch.compile works here"]
    assert "C++ compiler" in repr(verdict) and "NOT READY" in Verdict(verdict)._repr_html_()


def as_saved_after_a_run(path) -> str:
    """The chapter as JupyterLab's save writes it after a participant ran it: outputs (text,
    HTML, a widget), counts, run metadata, widget state and their Python's version, written by
    nbformat as jupyter_server writes it (sources sent as one string each)."""
    nb = json.loads(path.read_text())
    nb["metadata"]["language_info"]["version"] = "3.11.7"
    nb["metadata"]["widgets"] = {"application/vnd.jupyter.widget-state+json": {"state": {}}}
    for i, cell in enumerate(nb["cells"]):
        cell["source"] = "".join(cell["source"])
        cell["metadata"].update(execution={"iopub.status.busy": "2026-12-04T10:00:00Z"},
                                scrolled=True, trusted=True)
        if cell["cell_type"] == "code":
            cell["execution_count"] = i
            cell["outputs"] = [
                {"output_type": "stream", "name": "stdout", "text": "hello\nworld\n"},
                {"output_type": "display_data", "metadata": {}, "data": {
                    "text/html": "<table>\n<tr><td>1</td></tr>\n</table>", "text/plain": "T",
                    "application/vnd.jupyter.widget-view+json": {"model_id": "ab12"}}}]
    return nbformat.writes(nbformat.from_dict(nb)) + "\n"


def git(repo, *args) -> str:
    return subprocess.run(["git", "-c", "user.name=kit", "-c", "user.email=kit@example.org",
                           *args], cwd=repo, check=True, capture_output=True, text=True).stdout


def test_git_stores_a_run_chapter_as_the_stored_file(tmp_path):
    """Every chapter saved after a run, added in a clone whose filter is configured as
    ./setup.sh configures it (this .gitattributes, `stored_notebooks.py --git-config`): git
    stores the chapter in git byte for byte; once committed, a later save with other outputs
    shows nothing in `git diff`, and nothing to commit once added (`git status` lists a file
    whose size changed before it runs the filter). The file itself keeps its outputs."""
    from kit.execute.stored_notebooks import GIT_FILTER, git_config
    root = NOTEBOOKS_DIR.parent
    assert f"notebooks/*.ipynb filter={GIT_FILTER}" in (root / ".gitattributes").read_text()
    git(tmp_path, "init", "-q")
    shutil.copy(root / ".gitattributes", tmp_path)
    (tmp_path / "kit" / "execute").mkdir(parents=True)
    shutil.copy(root / "kit" / "execute" / "stored_notebooks.py", tmp_path / "kit" / "execute")
    git_config(tmp_path)
    (tmp_path / "notebooks").mkdir()
    chapters = sorted(NOTEBOOKS_DIR.glob("*.ipynb"))
    for path in chapters:
        (tmp_path / "notebooks" / path.name).write_text(as_saved_after_a_run(path))
    git(tmp_path / "notebooks", "add", ".")  # from a subfolder: git runs the filter at the top
    for path in chapters:
        assert git(tmp_path, "show", f":notebooks/{path.name}") == path.read_text(), path.name
        assert '"outputs": []' not in (tmp_path / "notebooks" / path.name).read_text()
    git(tmp_path, "commit", "-q", "-m", "chapters")
    for path in chapters:
        again = tmp_path / "notebooks" / path.name
        again.write_text(again.read_text().replace("hello", "hello again"))
    assert git(tmp_path, "diff", "notebooks") == ""
    git(tmp_path, "add", "notebooks")
    assert git(tmp_path, "status", "--porcelain", "notebooks") == ""


def test_the_clean_step_passes_what_is_not_a_notebook_unchanged():
    from kit.execute.stored_notebooks import clean
    for data in (b"", b"not json {", b'{"cells": 3}', b"[1, 2]"):
        assert clean(data) == data


def numbers_without_unit(results, units: dict, prefix: str = "") -> list[str]:
    """Dotted names of the recorded numbers that have no unit in `units` (a list's numbers
    share the list's name)."""
    if isinstance(results, dict):
        return [n for k, v in results.items()
                for n in numbers_without_unit(v, units, f"{prefix}.{k}" if prefix else k)]
    if isinstance(results, list):
        return sorted({n for v in results for n in numbers_without_unit(v, units, prefix)})
    number = isinstance(results, (int, float)) and not isinstance(results, bool)
    return [prefix] if number and prefix not in units else []


def test_every_recorded_number_has_its_unit(cpu_small_run):
    """Every number each chapter records is typed (`kit.units`), so the report shows bytes,
    seconds, rates and ratios as what they are, never guessed from a name."""
    from kit.units import QUANTITIES
    _, summary, folder = cpu_small_run
    for chapter in CHAPTERS:
        data = json.loads((folder / f"{chapter}.json").read_text())
        assert numbers_without_unit(data["results"], data["units"]) == [], chapter
        assert set(data["units"].values()) <= set(QUANTITIES), chapter
    for section in ("settings", "machine"):
        assert numbers_without_unit(summary[section], summary["units"], section) == []


@pytest.mark.vllm
def test_chapter_05s_engine_logs_explained(cpu_small_run):
    """The start-up logs of the engines chapter 05 started, as the kit captured them, explained
    by `kit explain`'s code: every number agrees, the tokens and concurrency among them."""
    from kit.vllm.log_numbers import explain
    from kit.vllm.startup_log import read_log_file
    _, summary, folder = cpu_small_run
    logs = sorted(folder.glob("vllm-*.log"))
    model = json.loads((folder / "05_vllm_side_by_side.json").read_text())["settings"]["model"]
    assert logs
    for path in logs:
        ex = explain(read_log_file(path), model)
        assert {"kv_cache_tokens", "max_concurrency"} <= {n.key for n in ex.numbers}, path
        assert all(n.agrees for n in ex.numbers if n.agrees is not None), path
