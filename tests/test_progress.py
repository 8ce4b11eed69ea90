"""The headless run's terminal line and its log, without running a notebook: the live line's text,
the plain lines off a terminal, and the log taking what would have cluttered the terminal."""
import io
import logging
import subprocess
import sys
import time

from kit.execute.progress import CLEAR_LINE, Progress, fit, last_line, live_line
from kit.execute.runlog import RunLog


def test_live_line_says_notebook_cell_seconds_and_last_printed_line():
    line = live_line(5, 6, "04_decode_timing", 5, 25, 41.4, "timed run 2/3: eager, stock")
    assert line == "[5/6] 04_decode_timing · cell 5/25 · 41 s · timed run 2/3: eager, stock"
    assert live_line(1, 6, "00_setup_check", None, 0, 0.2) == \
        "[1/6] 00_setup_check · starting the kernel · 0 s"


def test_live_line_is_cut_to_the_terminal_width():
    line = live_line(5, 6, "04_decode_timing", 5, 25, 41.4, "x" * 300, width=60)
    assert len(line) == 60 and line.endswith("…") and line.startswith("[5/6] 04_decode_timing")
    assert fit("short", 60) == "short" and fit("abcdef", 4) == "abc…"


def test_last_line_is_what_a_terminal_would_show_last():
    assert last_line("first\nsecond\n\n  \n") == "second"
    assert last_line("step 1/3\rstep 2/3\rstep 3/3") == "step 3/3"
    assert last_line("\x1b[31mred\x1b[0m\tand\x07 tab") == "red and tab"
    assert last_line("\n \n") == ""


def test_off_a_terminal_one_plain_line_at_the_start_and_one_at_the_end():
    out = io.StringIO()
    progress = Progress(1, 2, "02_kv_cache", animate=False, stream=out)
    progress.start()
    progress.cell_started(3, 16)
    progress.printed("CPU KV cache size: 917,216 tokens\n")
    progress.finish("[1/2] 02_kv_cache: ok in 15.1 s, 10/10 checks")
    assert out.getvalue() == ("[1/2] 02_kv_cache ...\n"
                              "[1/2] 02_kv_cache: ok in 15.1 s, 10/10 checks\n")


def test_on_a_terminal_the_line_is_redrawn_in_place_while_a_cell_runs():
    out = io.StringIO()
    progress = Progress(1, 1, "04_decode_timing", animate=True, stream=out, tick=0.01)
    progress.start()
    progress.cell_started(5, 25)
    progress.printed("timed run 2/3: eager\n")
    drawn = out.getvalue().count(CLEAR_LINE)
    deadline = time.monotonic() + 10
    while out.getvalue().count(CLEAR_LINE) < drawn + 3 and time.monotonic() < deadline:
        time.sleep(0.01)  # the ticker redraws with no event at all
    progress.finish("[1/1] 04_decode_timing: ok in 1.0 s, 3/3 checks")
    text = out.getvalue()
    assert text.count(CLEAR_LINE) >= drawn + 4  # three ticks and the result line
    assert "cell 5/25" in text and "timed run 2/3: eager" in text
    assert text.endswith(CLEAR_LINE + "[1/1] 04_decode_timing: ok in 1.0 s, 3/3 checks\n")


def test_the_log_takes_library_logs_and_a_child_process_output(tmp_path, capfd):
    with RunLog(tmp_path / "kernel.log") as log:
        logging.getLogger("papermill").warning("Passed unknown parameter: colour")
        with log.kernel_output() as fd:
            subprocess.run([sys.executable, "-c", "import os; os.write(2, b'C-level\\n')"],
                           stdout=fd, stderr=fd, check=True)
        log.printed(4, "stdout", "one\ntwo\n")
    text = (tmp_path / "kernel.log").read_text()
    assert "papermill WARNING Passed unknown parameter: colour" in text
    assert "C-level\n" in text and "[cell 4] one\n[cell 4] two\n" in text
    out, err = capfd.readouterr()
    assert "colour" not in out + err and "C-level" not in out + err
    assert logging.getLogger("papermill").propagate  # as it was before the run


def test_with_echo_the_terminal_gets_the_noise_too(tmp_path, capfd):
    with RunLog(tmp_path / "kernel.log", echo=True) as log:
        logging.getLogger("nbclient").warning("Timeout waiting for IOPub output")
        with log.kernel_output() as fd:
            subprocess.run([sys.executable, "-c", "import os; os.write(1, b'C-level\\n')"],
                           stdout=fd, stderr=fd, check=True)
    err = capfd.readouterr().err
    assert "Timeout waiting for IOPub output" in err and "C-level" in err
    text = (tmp_path / "kernel.log").read_text()
    assert "Timeout waiting for IOPub output" in text and "C-level" in text
