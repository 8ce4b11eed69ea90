"""The run report and the comparison of two runs, read as HTML (tests/test_browser.py opens
them in a real browser)."""
import json
import re

import pytest
from plotly.offline import get_plotlyjs

from kit.cli.main import main
from kit.pages.report import numeric_rows, load_run, write_compare, write_report_safely

PLOTLY_HEADER = get_plotlyjs()[:120]  # the bundle's licence header, once per copy


def sections(page: str) -> list[str]:
    """Notebook ids of the report's sections, in page order."""
    return re.findall(r'<section class="notebook[^"]*" id="([^"]+)"', page)


def test_the_run_writes_a_self_contained_report(cpu_small_run):
    _, summary, folder = cpu_small_run
    page = (folder / "report.html").read_text()
    assert page.count(PLOTLY_HEADER) == 1, "plotly.js must be inlined exactly once"
    assert not re.search(r'<(?:script|link|img|iframe)[^>]+(?:src|href)="(?:https?:)?//', page), \
        "the report must not fetch anything"
    figures = sorted(p.stem for p in (folder / "figures").glob("*.json"))
    assert figures and sorted(re.findall(r'class="figure kit-figure"[^>]*data-name="([^"]+)"', page)) == figures
    assert sections(page) == [nb["notebook"] for nb in summary["notebooks"]]  # all passed: run order
    assert summary["versions"]["torch"] in page and "max_num_batched_tokens" in page
    for nb in summary["notebooks"]:
        link = f'{nb["notebook"]}.html'
        assert f'href="{link}"' in page and (folder / link).is_file()
        notebook_page = (folder / link).read_text()
        assert not re.search(r'<script[^>]+src="(?:https?:)?//', notebook_page)


def test_failed_notebooks_come_first_with_their_failing_cell(not_ready_run):
    code, summary, folder = not_ready_run
    assert code == 1 and [nb["ok"] for nb in summary["notebooks"]] == [True, False]
    page = (folder / "report.html").read_text()
    assert sections(page) == ["00_setup_check", "passing"]
    failed = page.split('id="00_setup_check"', 1)[1].split("</section>", 1)[0]
    assert "CheckFailed" in failed and "<pre>rec.finish()</pre>" in failed
    assert 'href="00_setup_check.html#papermill-error-cell"' in failed
    # the failed check is listed first, in a failing row
    assert re.search(r'<tbody><tr class="fail"><td><span class="fail">FAIL</span></td>'
                     r"<td>the budget leaves room for a model</td>", failed)
    assert 'data-name="passing--bars"' in page  # figures of any notebook, not only chapters


def test_chapter_00_says_not_ready_and_what_to_do(not_ready_run):
    _, _, folder = not_ready_run
    recorded = json.loads((folder / "00_setup_check.json").read_text())
    assert recorded["results"]["ready"] is False
    notebook_page = (folder / "00_setup_check.html").read_text()
    assert f"NOT READY: 1 of {len(recorded['checks'])} checks failed" in notebook_page
    assert "the budget leaves room for a model</b>: Give the kit more memory" in notebook_page


def test_compare_lines_up_numbers_with_ratios_and_figures(cpu_small_run, not_ready_run, tmp_path):
    (_, _, a), (_, _, b) = cpu_small_run, not_ready_run
    rows = {(ch, name): (va, vb) for ch, name, va, vb, _ in numeric_rows(load_run(a), load_run(b))}
    assert rows[("00_setup_check", "capacity_bytes")] == (96 * 2**20, 32 * 2**20)
    assert rows[("passing", "nested.half_bytes")] == (None, 2048)  # only in B
    assert ("01_memory_profiling", "eager.peak_activation_bytes") in rows  # only in A
    out = write_compare(a, b, tmp_path / "compare.html")
    page = out.read_text()
    assert page.count(PLOTLY_HEADER) == 1
    row = re.search(r"<code>capacity_bytes</code></td>(.*?)</tr>", page).group(1)
    assert "0.3333×" in row  # 32 MiB ÷ 96 MiB
    in_a, in_b = ({p.name for p in run.glob("figures/*.json")} for run in (a, b))
    assert page.count('class="figure kit-figure') == len(in_a) + len(in_b)  # once per run
    assert in_a & in_b  # chapter 00's figure is in both runs, side by side
    assert page.count("only in A") + page.count("only in B") == len(in_a ^ in_b)


def test_report_and_compare_commands(cpu_small_run, tmp_path, capsys):
    _, _, folder = cpu_small_run
    assert main(["report", str(folder)]) == 0
    assert f"report: {folder / 'report.html'}" in capsys.readouterr().out
    assert main(["compare", str(folder), str(folder), "--out", str(tmp_path / "c.html")]) == 0
    assert (tmp_path / "c.html").is_file()
    assert main(["report", str(tmp_path)]) == 2
    assert "is not a run folder (no summary.json)" in capsys.readouterr().err


def test_a_report_that_cannot_be_written_does_not_fail_the_run(tmp_path, capsys):
    assert write_report_safely(tmp_path) is None
    assert "report: not written (ConfigError" in capsys.readouterr().out


def test_an_older_run_reads_with_todays_names(cpu_small_run, tmp_path):
    """A run recorded when vLLM #7796 was "the seed" (`seed_kv_ratio`, ...) lines up with today's
    names in the report and in `kit compare`; the random seed (`seed`) keeps its name."""
    import shutil
    _, _, folder = cpu_small_run
    old = shutil.copytree(folder, tmp_path / "old")
    path = old / "01_memory_profiling.json"
    recorded = json.loads(path.read_text())
    results = recorded["results"]
    assert "pr_kv_ratio" in results and recorded["settings"]["seed"] == 0
    recorded["results"] = {k.replace("pr_", "seed_", 1): v for k, v in results.items()}
    path.write_text(json.dumps(recorded))
    summary = json.loads((old / "summary.json").read_text())
    for nb in summary["notebooks"]:
        nb["recorded"] = None  # read from the chapter's file, as for any run folder
    (old / "summary.json").write_text(json.dumps(summary))
    rows = {(ch, name): (va, vb) for ch, name, va, vb, _ in numeric_rows(load_run(old), load_run(folder))}
    ratio = rows[("01_memory_profiling", "pr_kv_ratio")]
    assert ratio[0] == ratio[1] is not None
    assert not any("seed_" in name for _, name in rows)
