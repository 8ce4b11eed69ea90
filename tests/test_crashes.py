"""A test run always ends: a test that kills its worker fails by name, and the rest run
(tests/crash_safe_scheduling.py). Native calls that could end the process are tried in a child
first (kit.measure.in_child), where a crash is a reason in words."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kit.measure.in_child import try_in_child

ROOT = Path(__file__).resolve().parent.parent
CRASHING = Path(__file__).parent / "fixtures" / "crashing_suite.py"


def test_a_test_that_kills_its_worker_fails_by_name_and_the_run_ends():
    """The fixture suite in a child pytest with this suite's options (pyproject's addopts: two
    workers, --dist loadgroup): xdist 3.8.0's own scheduler hangs there after the first crash,
    with every worker idle; the suite's ends with both crashes failed and the 26 others run."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "COV_"))}
    try:
        done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider",
                               str(CRASHING)], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=240)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the run did not end in {e.timeout} s: {(e.stdout or '')[-2000:]}")
    out = done.stdout
    assert done.returncode == 1, out[-3000:]
    assert "2 failed, 26 passed" in out.splitlines()[-1], out[-3000:]
    for name in ("test_dies_of_an_illegal_instruction", "test_in_a_group_one_of_which_aborts[1]"):
        assert f"crashed while running 'tests/fixtures/crashing_suite.py::{name}" in out, out


def test_a_child_that_dies_is_a_reason_in_words():
    assert try_in_child("print('fine')") is None
    assert try_in_child("import os, signal; os.kill(os.getpid(), signal.SIGILL)") == \
        "killed by SIGILL (an instruction this CPU does not have)"
    assert try_in_child("import os; os.abort()") == "killed by SIGABRT (an abort in native code)"
    assert try_in_child("import sys; sys.exit('the kernel multiplied wrong')") == \
        "the kernel multiplied wrong"
    assert try_in_child("import time; time.sleep(5)", timeout=0.5) == "did not finish in 0 s"
