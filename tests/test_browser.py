"""JupyterLab and the run report in a real browser: Debian's Chromium, driven by Playwright.

The tests never download a browser: they launch the system's Chromium (`./setup.sh` installs
Debian's with apt-get; `KIT_CHROMIUM` names another) and fail, saying so, when it is missing.
Screenshots go to the folder named at the end of the test session (conftest.ARTIFACTS).
"""
import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from types import SimpleNamespace

import pytest

from kit.cli.lab import lab_command
from kit.cli.working_copies import make_copies
from kit.pages.report import write_compare
from kit.execute.notebooks import NOTEBOOKS_DIR, kernel_env
from kit.execute.stored_notebooks import clean

pytestmark = pytest.mark.browser
CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run"]
NO_CHROMIUM = ("Chromium not found (looked at $KIT_CHROMIUM, then `chromium` and `chromium-browser` "
               "on PATH). Run ./setup.sh, which installs Debian's chromium with apt-get, or "
               "`apt-get install chromium`, or set KIT_CHROMIUM=/path/to/chromium. These tests "
               "never download a browser.")


def chromium_path() -> str:
    path = (os.environ.get("KIT_CHROMIUM") or shutil.which("chromium")
            or shutil.which("chromium-browser"))
    if not path or not os.access(path, os.X_OK):
        pytest.fail(NO_CHROMIUM, pytrace=False)
    return path


@pytest.fixture(scope="module")
def browser():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail("playwright is not installed: run ./setup.sh (it is in the test extra)",
                    pytrace=False)
    executable = chromium_path()
    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=executable, args=CHROMIUM_FLAGS)
        yield chromium
        chromium.close()


class Watched:
    """A page whose JavaScript errors and requests outside `allowed` origins are collected
    (those requests are refused, so nothing reaches a network)."""

    def __init__(self, browser, allowed: tuple[str, ...], width=1400, height=1000):
        self.context = browser.new_context(viewport={"width": width, "height": height})
        self.errors, self.refused = [], []
        self.context.route("**/*", self._route(allowed))
        self.page = self.context.new_page()
        self.page.on("pageerror", lambda e: self.errors.append(f"page error: {e}"))
        self.page.on("console", lambda m: m.type == "error" and self.errors.append(
            f"console error: {m.text}"))

    def _route(self, allowed):
        def handle(route):
            if route.request.url.startswith(allowed):
                route.continue_()
            else:
                self.refused.append(route.request.url)
                route.abort()
        return handle

    def close(self):
        self.context.close()


# ------------------------------------------------------------------ JupyterLab

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """JupyterLab on 127.0.0.1 with a token, serving working copies of the chapters made as
    `kit lab` makes them, in a temporary folder; its kernels import this checkout's kit and
    record into a temporary run folder. Torn down after."""
    root = make_copies(tmp_path_factory.mktemp("lab") / "work").folder
    settings = root / ".settings"
    news = settings / "@jupyterlab" / "apputils-extension" / "notification.jupyterlab-settings"
    news.parent.mkdir(parents=True)
    news.write_text(json.dumps({"fetchNews": "false", "checkForUpdates": False}))
    port, token = free_port(), secrets.token_hex(16)
    env = dict(kernel_env(), KIT_RUN_DIR=str(root / "runs"), JUPYTERLAB_SETTINGS_DIR=str(settings),
               JUPYTERLAB_WORKSPACES_DIR=str(root / ".workspaces"),
               JUPYTER_RUNTIME_DIR=str(root / ".runtime"))
    cmd = lab_command("127.0.0.1", port, token, open_browser=False, root=root)  # `kit lab`'s
    log = root / "jupyterlab.log"
    with open(log, "w") as out:
        server = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=root)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=2)
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"JupyterLab did not start:\n{log.read_text()[-3000:]}")
                time.sleep(0.5)
        yield SimpleNamespace(url=url, token=token, root=root, log=log)
    finally:
        server.terminate()
        try:
            server.wait(20)
        except subprocess.TimeoutExpired:
            server.kill()


def blocks(numbers: str) -> int:
    """The block count the calculator shows ("57,406 blocks · ...")."""
    return int(re.match(r"\s*([\d,]+) blocks", numbers).group(1).replace(",", ""))


def drag(page, handle, dx: float):
    """Drag a slider's handle dx pixels, as a person would with the mouse. JupyterLab may still
    scroll the notebook after a run, so press only once the pointer is really on the handle."""
    for _ in range(40):
        handle.scroll_into_view_if_needed()
        box = handle.bounding_box()
        x, y = box["x"] + box["width"] / 2, box["y"] + box["height"] / 2
        page.mouse.move(x, y)
        if handle.evaluate("(h, [x, y]) => h.contains(document.elementFromPoint(x, y))", [x, y]):
            break
        page.wait_for_timeout(250)
    else:
        pytest.fail("the slider's handle never stayed under the pointer")
    page.mouse.down()
    page.mouse.move(x + dx, y)  # one step: one new value, so one update of the calculator
    page.mouse.up()


# The num_blocks cell of chapter 02's sizing table (the table with a "KV budget" column).
SIZING_TABLE_BLOCKS = """() => {
  for (const t of document.querySelectorAll('.jp-OutputArea table')) {
    const heads = [...t.querySelectorAll('th')].map(h => h.textContent.trim());
    const i = heads.indexOf('num_blocks');
    if (i >= 0 && heads.includes('KV budget')) return t.querySelectorAll('tbody tr td')[i].textContent;
  }
  return null;
}"""


UNSAVED_TAB = ".lm-TabBar-tab.jp-mod-current.jp-mod-dirty"  # the tab's "unsaved" dot


def test_calculator_in_jupyterlab(browser, lab, artifact):
    """Run chapter 02's working copy in JupyterLab, move the calculator's controls: numbers and
    figure follow. Save, close and reopen it: the outputs are still there."""
    failure_shot = artifact("jupyterlab-02-failure.png")
    failure_shot.unlink(missing_ok=True)  # from an earlier session
    original = (NOTEBOOKS_DIR / "02_kv_cache.ipynb").read_bytes()
    w = Watched(browser, (lab.url,))
    page = w.page
    try:
        page.goto(f"{lab.url}/lab/tree/02_kv_cache.ipynb?token={lab.token}")
        # the status bar says Idle once the kernel is started and connected, not before
        page.get_by_text(re.compile(r"^Python 3 \(ipykernel\) \| Idle$")).wait_for(timeout=90_000)
        # Lab writes the kernel's language_info into the notebook as it connects: the copy
        # already holds it, so nothing is marked unsaved
        page.wait_for_timeout(1000)
        assert page.locator(UNSAVED_TAB).count() == 0, "opened marked unsaved"
        page.get_by_role("menuitem", name="Run", exact=True).click()
        page.get_by_role("menuitem", name="Run All Cells", exact=True).click()
        page.locator(".jp-InputPrompt").filter(has_text="[1]:").wait_for(timeout=60_000)
        finished = page.get_by_text(re.compile(r"02_kv_cache: \d+/\d+ checks passed"))
        finished.wait_for(timeout=240_000)
        passed, total = map(int, re.search(r"(\d+)/(\d+)", finished.inner_text()).groups())
        assert passed == total >= 3

        calculator = page.locator(".widget-vbox").filter(has=page.locator(".kit-calculator-numbers"))
        numbers = calculator.locator(".kit-calculator-numbers")
        figure = calculator.locator(".js-plotly-plot")

        def drawn():
            """(figure title, KV cache bar in GiB) as plotly drew them."""
            title = figure.locator(".gtitle").text_content()
            kv = figure.evaluate("gd => gd.data.find(t => t.name === 'KV cache').y[0]")
            return title, kv

        start = numbers.inner_text()
        title, kv = drawn()
        assert title.startswith(f"{blocks(start):,} blocks")
        # it opens at the notebook's own settings: the blocks of the sizing table above it
        table_blocks = page.evaluate(SIZING_TABLE_BLOCKS)
        assert table_blocks and blocks(start) == int(table_blocks.replace(",", "")), \
            (start, table_blocks)
        memory = calculator.locator(".widget-slider").filter(has_text="device_memory")
        assert memory.locator(".widget-readout").inner_text() == "96 MiB"  # the preset's

        # drag gpu_memory_utilization to the left: less memory for the cache
        slider = calculator.locator(".widget-slider").filter(has_text="gpu_memory_utilization")
        drag(page, slider.locator(".noUi-handle"), -60)
        page.wait_for_function("([el, before]) => el.innerText !== before",
                               arg=[numbers.element_handle(), start], timeout=30_000)
        moved = numbers.inner_text()
        assert float(slider.locator(".widget-readout").inner_text()) < 0.9
        assert blocks(moved) < blocks(start)
        page.wait_for_function(
            "([box, text]) => (box.querySelector('.js-plotly-plot .gtitle') || {}).textContent"
            "?.startsWith(text)", arg=[calculator.element_handle(), f"{blocks(moved):,} blocks"],
            timeout=30_000)
        assert drawn()[1] < kv

        # one byte per element instead of two: twice the blocks from the same budget
        calculator.locator(".widget-dropdown").filter(has_text="kv_cache_dtype") \
            .locator("select").select_option("fp8")
        page.wait_for_function("([el, before]) => el.innerText !== before",
                               arg=[numbers.element_handle(), moved], timeout=30_000)
        fp8 = numbers.inner_text()
        assert blocks(fp8) in (2 * blocks(moved), 2 * blocks(moved) + 1)
        page.wait_for_function(
            "([box, text]) => (box.querySelector('.js-plotly-plot .gtitle') || {}).textContent"
            "?.startsWith(text)", arg=[calculator.element_handle(), f"{blocks(fp8):,} blocks"],
            timeout=30_000)
        # and back: the numbers and the figure of before
        calculator.locator(".widget-dropdown").filter(has_text="kv_cache_dtype") \
            .locator("select").select_option("auto")
        page.wait_for_function("([el, before]) => el.innerText === before",
                               arg=[numbers.element_handle(), moved], timeout=30_000)
        page.wait_for_function(
            "([box, text]) => (box.querySelector('.js-plotly-plot .gtitle') || {}).textContent"
            "?.startsWith(text)", arg=[calculator.element_handle(), f"{blocks(moved):,} blocks"],
            timeout=30_000)

        calculator.scroll_into_view_if_needed()
        page.screenshot(path=artifact("jupyterlab-02-calculator.png"))

        # saving keeps the outputs in the working copy; git's clean step (the filter) would
        # store it as the chapter in git, byte for byte, which stays as it was
        saved = lab.root / "02_kv_cache.ipynb"
        before = saved.stat().st_mtime_ns
        page.get_by_role("menuitem", name="File", exact=True).click()
        page.locator('.lm-Menu-item[data-command="docmanager:save"]').click()
        deadline = time.monotonic() + 120  # Lab sends the whole notebook, figures included
        # written in place: done once the server answered and Lab took the unsaved mark off
        while (saved.stat().st_mtime_ns == before or page.locator(UNSAVED_TAB).count()) \
                and time.monotonic() < deadline:
            page.wait_for_timeout(200)  # not time.sleep: the page's requests pass through here
        assert saved.stat().st_mtime_ns != before, "File → Save Notebook did not save"
        assert page.locator(UNSAVED_TAB).count() == 0, "still unsaved after saving"
        cells = json.loads(saved.read_text())["cells"]
        assert sum(len(c.get("outputs", [])) for c in cells) >= 20
        assert clean(saved.read_bytes()) == original
        assert (NOTEBOOKS_DIR / "02_kv_cache.ipynb").read_bytes() == original

        # close it and open it again from the file browser: the outputs are there, the
        # calculator where it was left, and nothing is marked unsaved
        page.get_by_role("menuitem", name="File", exact=True).click()
        page.locator('.lm-Menu-item[data-command="application:close"]').click()
        page.locator(".jp-NotebookPanel").wait_for(state="detached", timeout=30_000)
        page.locator(".jp-DirListing-item").filter(has_text="02_kv_cache.ipynb").dblclick()
        finished = page.get_by_text(re.compile(r"02_kv_cache: \d+/\d+ checks passed"))
        finished.wait_for(state="attached", timeout=60_000)  # drawn only once scrolled to
        assert re.search(r"(\d+)/(\d+)", finished.text_content()).groups() == (str(passed),
                                                                                 str(total))
        assert page.evaluate(SIZING_TABLE_BLOCKS) == table_blocks
        numbers = page.locator(".kit-calculator-numbers")
        numbers.scroll_into_view_if_needed()
        page.wait_for_function("([el, want]) => el.innerText === want",
                               arg=[numbers.element_handle(), moved], timeout=30_000)
        numbers.scroll_into_view_if_needed()  # again: the cells above it are drawn by now
        page.screenshot(path=artifact("jupyterlab-02-reopened.png"))
        assert page.locator(UNSAVED_TAB).count() == 0, "reopened marked unsaved"
        assert not w.errors, w.errors
        assert not w.refused, f"JupyterLab asked for more than its server: {w.refused}"
    except Exception:
        page.screenshot(path=failure_shot)
        raise
    finally:
        w.close()


CALCULATOR_CELL = """import kit
from kit.measure.device import capacity_bytes
from kit.show import widgets
from kit.studies import kv_cache_sizing
settings = kit.notebook_settings(globals())
capacity = capacity_bytes(settings.device, settings.device_memory)
compute = kv_cache_sizing.Calculator(settings, 10 * 2**20)
calculator = widgets.kv_calculator(settings, capacity, compute, kv_cache_sizing.LAYER_PATTERNS)"""


def choose(page, box, label: str, value: str, wait_for: str) -> str:
    """Pick `value` in the calculator's dropdown named `label`; the numbers once they say
    `wait_for`."""
    box.locator(".widget-dropdown").filter(
        has=page.locator("label", has_text=re.compile(f"^{label}$"))).locator("select") \
        .select_option(value)
    numbers = box.locator(".kit-calculator-numbers")
    page.wait_for_function("([el, text]) => el.innerText.includes(text)",
                           arg=[numbers.element_handle(), wait_for], timeout=30_000)
    return numbers.inner_text()


def test_the_calculator_computes_at_the_memory_it_shows(browser, lab, artifact):
    """Chapter 02's calculator in a notebook of its own (chapter 02's parameters, a fixed 10 MiB
    of activations, so no profile runs): choosing mistral-7b-v0.1 moves the memory to 16 GiB,
    the slider reads 16 GiB and the numbers are the kit's `Calculator` at exactly 16 GiB; chosen
    after tiny, after deepseek-v3 and after qwen3.5-27b, the numbers are the same."""
    import nbformat
    from kit.config import load
    from kit.studies.kv_cache_sizing import Calculator
    chapter = nbformat.read(NOTEBOOKS_DIR / "02_kv_cache.ipynb", as_version=4)
    chapter.cells = [chapter.cells[1], nbformat.v4.new_code_cell(CALCULATOR_CELL)]
    nbformat.write(chapter, lab.root / "calculator.ipynb")
    kit = Calculator(load("cpu-small"), 10 * 2**20)(
        model="mistral-7b-v0.1", capacity_bytes=16 * 2**30, gpu_memory_utilization=0.9,
        block_size=16, kv_cache_dtype="auto", max_model_len=1024).config
    w = Watched(browser, (lab.url,))
    page = w.page
    try:
        page.goto(f"{lab.url}/lab/workspaces/calculator/tree/calculator.ipynb?token={lab.token}")
        page.get_by_text(re.compile(r"^Python 3 \(ipykernel\) \| Idle$")).wait_for(timeout=90_000)
        page.get_by_role("menuitem", name="Run", exact=True).click()
        page.get_by_role("menuitem", name="Run All Cells", exact=True).click()
        box = page.locator(".widget-vbox").filter(has=page.locator(".kit-calculator-numbers"))
        box.locator(".kit-calculator-numbers").wait_for(timeout=90_000)
        memory = box.locator(".widget-slider").filter(has_text="device_memory")
        shown = []
        for before, note in (("tiny", None), ("deepseek-v3", "moved to 192 GiB"),
                             ("qwen3.5-27b", "moved to 80 GiB")):
            if note:
                choose(page, box, "model", before, note)
            numbers = choose(page, box, "model", "mistral-7b-v0.1", "moved to 16 GiB")
            assert memory.locator(".widget-readout").inner_text() == "16 GiB"
            assert blocks(numbers) == kit.num_blocks == 182
            assert f"{kit.num_tokens:,} tokens" in numbers
            assert f"{kit.max_concurrency:.2f}× concurrency" in numbers
            page.wait_for_function(
                "([box, text]) => (box.querySelector('.js-plotly-plot .gtitle') || {})"
                ".textContent?.startsWith(text)", arg=[box.element_handle(), "182 blocks"],
                timeout=30_000)
            shown.append(numbers)
        assert len(set(shown)) == 1, shown
        box.scroll_into_view_if_needed()
        page.screenshot(path=artifact("jupyterlab-calculator-16gib.png"))
        assert not w.errors, w.errors
    finally:
        w.close()


def test_a_bad_parameter_reads_as_one_line_in_jupyterlab(browser, lab, artifact):
    """A participant's mistake in the parameters cell (`block_size = 17`) shows under the
    settings cell as the kit's one-line message, no traceback through kit/config."""
    import nbformat
    chapter = nbformat.read(NOTEBOOKS_DIR / "02_kv_cache.ipynb", as_version=4)
    code = [c for c in chapter.cells if c.cell_type == "code"][:2]  # parameters, settings
    code[0].source = code[0].source.replace("block_size = None", "block_size = 17", 1)
    assert "block_size = 17" in code[0].source
    chapter.cells = code
    nbformat.write(chapter, lab.root / "bad_parameter.ipynb")
    w = Watched(browser, (lab.url,))
    page = w.page
    try:
        # a workspace of its own: the one the calculator's test left would reopen chapter 02
        page.goto(f"{lab.url}/lab/workspaces/bad-parameter/tree/bad_parameter.ipynb"
                  f"?token={lab.token}")
        page.get_by_text(re.compile(r"^Python 3 \(ipykernel\) \| Idle$")).wait_for(timeout=90_000)
        page.get_by_role("menuitem", name="Run", exact=True).click()
        page.get_by_role("menuitem", name="Run All Cells", exact=True).click()
        error = page.locator('.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]')
        error.first.wait_for(timeout=90_000)
        lines = [line for line in error.first.inner_text().splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith(
            "ConfigError: block_size=17 must be a power of two"), lines
        assert error.count() == 1 and "Traceback" not in page.content()
        page.screenshot(path=artifact("jupyterlab-bad-parameter.png"))
    finally:
        w.close()


# ------------------------------------------------------------------ the report pages

def open_offline(browser, path, artifact, shot: str):
    """Open a local page with every network request refused; wait for its figures."""
    w = Watched(browser, ("file://",), width=1280, height=900)
    w.page.goto(path.as_uri())
    w.page.wait_for_load_state("load")
    w.page.wait_for_function(
        "() => [...document.querySelectorAll('.kit-figure')].every(d => d.classList.contains('kit-drawn'))",
        timeout=30_000)
    w.page.screenshot(path=artifact(shot), full_page=True)
    return w


def figures_drawn(page, selector: str) -> list[int]:
    """For each figure: how many traces plotly drew in its SVG (0 when not drawn)."""
    return page.eval_on_selector_all(
        selector, "divs => divs.map(d => d.querySelectorAll('.main-svg g.trace, .main-svg g.hm').length)")


def assert_findings_lead(page, folder):
    """The report opens with what the run found, above the parameters, and its numbers are
    the recorded ones: chapter 01's KV ratio beside the PR's, chapter 04's quickest step,
    chapter 05's best-step ratio."""
    findings = page.locator("#findings")
    assert findings.is_visible()
    above = page.evaluate("() => document.querySelector('#findings').getBoundingClientRect().top"
                          " < [...document.querySelectorAll('h2')].find(h => h.textContent === "
                          "'Parameters').getBoundingClientRect().top")
    assert above
    rows = {r.locator("td").nth(1).inner_text(): r.locator("td").nth(2).inner_text()
            for r in findings.locator("tbody tr").all()}
    results = {n: json.loads((folder / f"{n}.json").read_text())["results"]
               for n in ("01_memory_profiling", "04_decode_timing", "05_vllm_side_by_side")}
    kv = next(v for k, v in rows.items() if k.startswith("KV cache left by a compiled"))
    assert kv == f"{results['01_memory_profiling']['kv_ratio_compiled_over_eager']:.2f}×"
    decode = results["04_decode_timing"]
    step = decode["strategies"][decode["best_strategy"]]["median_step_seconds"]
    assert next(v for k, v in rows.items() if k.startswith("the quickest decode step")) \
        .startswith(f"{step * 1e3:.3g} ms")
    ratio = results["05_vllm_side_by_side"]["best_ratio_kit_over_vllm"]
    assert next(v for k, v in rows.items() if k.startswith("the kit's best decode step")) \
        .startswith(f"{ratio:.2f}×")


def test_report_pages_draw_every_figure_offline(browser, cpu_small_run, not_ready_run, artifact,
                                                tmp_path):
    _, _, folder = cpu_small_run
    compare = write_compare(folder, not_ready_run[2], tmp_path / "compare.html")
    pages = [(folder / "report.html", "report.png", ".kit-figure",
              len(list(folder.glob("figures/*.json")))),
             (not_ready_run[2] / "report.html", "report-failed.png", ".kit-figure",
              len(list(not_ready_run[2].glob("figures/*.json")))),
             (compare, "compare.png", ".kit-figure", len(list(folder.glob("figures/*.json")))
              + len(list(not_ready_run[2].glob("figures/*.json")))),
             # chapter 02 draws the five figures it records and gemma-3-1b's groups
             (folder / "02_kv_cache.html", "notebook-02.png", ".plotly-graph-div",
              len(list(folder.glob("figures/02_kv_cache--*.json"))) + 1)]
    for path, shot, selector, expected in pages:
        w = open_offline(browser, path, artifact, shot)
        try:
            if shot == "report.png":
                assert_findings_lead(w.page, folder)
            drawn = figures_drawn(w.page, selector)
            assert len(drawn) == expected and all(drawn), (path.name, drawn)
            assert not w.errors, (path.name, w.errors)
            assert not w.refused, (path.name, w.refused)
        finally:
            w.close()


def test_sweep_page_draws_every_figure_offline(browser, chapter02_sweep, artifact):
    """The sweep page of the 2 × 2 chapter 02 sweep: a figure per number that varies and swept
    parameter, every one drawn, no network request; a point's link opens its run's report."""
    _, folder = chapter02_sweep
    points = json.loads((folder / "sweep.json").read_text())["points"]
    names = {n for p in points for n in p["results"]}
    varying = [n for n in names if len({p["results"].get(n) for p in points}) > 1]
    w = open_offline(browser, folder / "sweep.html", artifact, "sweep.png")
    try:
        drawn = figures_drawn(w.page, ".kit-figure")
        assert len(drawn) == 2 * len(varying) and all(drawn), drawn
        assert not w.errors and not w.refused, (w.errors, w.refused)
        # it leads with what moved: num_blocks' smallest and largest, read back from the page
        row = w.page.locator("#findings tbody tr").filter(has_text="02_kv_cache.num_blocks")
        blocks = [p["results"]["02_kv_cache.num_blocks"] for p in points]
        cells = [row.locator("td").nth(i).inner_text() for i in (1, 2, 3)]
        assert cells[0].startswith(f"{min(blocks):,} at")
        assert cells[1].startswith(f"{max(blocks):,} at")
        assert cells[2] == f"{max(blocks) / min(blocks):.3g}×"
        w.page.click(f"text={points[0]['name']}")
        w.page.wait_for_function(
            "() => [...document.querySelectorAll('.kit-figure')].every(d => d.classList.contains('kit-drawn'))",
            timeout=30_000)
        assert w.page.url.endswith(f"{points[0]['name']}/report.html")
        assert all(figures_drawn(w.page, ".kit-figure"))
        assert not w.errors and not w.refused, (w.errors, w.refused)
    finally:
        w.close()


def test_kit_lab_refuses_a_port_in_use_before_starting(capsys):
    from kit.cli.main import main
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["lab", "--no-browser", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"cannot listen on 127.0.0.1:{port}" in err and "Traceback" not in err
    assert main(["lab", "--port", "70000"]) == 2


def test_kit_lab_prints_an_address_that_serves_the_chapters(tmp_path):
    """`python -m kit lab`: the printed address (token included) opens JupyterLab on the
    participant's copies of the chapters, as root too, with JupyterLab's news pop-up switched
    off; it says where the copies are and how to start over."""
    port, work = free_port(), tmp_path / "work"
    env = dict(os.environ, JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"),
               JUPYTERLAB_WORKSPACES_DIR=str(tmp_path / "workspaces"))
    env.pop("JUPYTER_TOKEN", None)
    server = subprocess.Popen([sys.executable, "-m", "kit", "lab", "--no-browser", "--port",
                               str(port), "--work", str(work)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    try:
        lines = [server.stdout.readline() for _ in range(5)]
        assert lines[0].startswith(f"JupyterLab on {work} "), lines
        url = lines[1].strip()
        assert lines[3].startswith(f"Your copies of the chapters are in {work}: "), lines
        assert lines[4].startswith("To start over: `python -m kit lab --fresh`"), lines
        assert re.fullmatch(rf"http://127\.0\.0\.1:{port}/lab\?token=[0-9a-f]{{48}}", url), lines
        token = url.split("token=")[1]
        deadline = time.monotonic() + 90
        while True:
            try:
                urllib.request.urlopen(url, timeout=2).read()
                break
            except OSError:
                assert server.poll() is None and time.monotonic() < deadline, \
                    server.stdout.read() if server.poll() is not None else "no answer in 90 s"
                time.sleep(0.5)
        api = f"http://127.0.0.1:{port}/api/contents?token={token}"
        names = {c["name"] for c in json.load(urllib.request.urlopen(api))["content"]}
        assert {p.name for p in NOTEBOOKS_DIR.glob("*.ipynb")} <= names
        assert {p.name for p in work.glob("*.ipynb")} == \
            {p.name for p in NOTEBOOKS_DIR.glob("*.ipynb")}
        news = json.load(urllib.request.urlopen(
            f"http://127.0.0.1:{port}/lab/api/settings/@jupyterlab/apputils-extension:notification"
            f"?token={token}"))
        defaults = news["schema"]["properties"]  # the environment's overrides change these
        assert defaults["fetchNews"]["default"] == "false"
        assert defaults["checkForUpdates"]["default"] is False
        with pytest.raises(urllib.error.HTTPError):  # and nothing without the token
            urllib.request.urlopen(f"http://127.0.0.1:{port}/api/contents")
    finally:
        server.terminate()
        server.wait(30)
