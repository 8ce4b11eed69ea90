import json
import os
import time
from pathlib import Path

import pytest

if os.environ.get("PYTEST_XDIST_WORKER"):
    # Two workers on a 2-core machine: OpenMP threads that wait for work sleep instead of
    # spinning, so one worker's idle threads do not take the cores from the other's (the
    # kernels and engines the tests start inherit it). Results are the same; tests time nothing.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from crash_safe_scheduling import CrashSafeLoadGroupScheduling  # noqa: E402
from kit.execute.notebooks import run  # noqa: E402 (after the wait policy is set)

ROOT = Path(__file__).resolve().parent.parent
# Screenshots of the browser tests: a folder out of git (runs/ is ignored), named at the end.
ARTIFACTS = Path(os.environ.get("KIT_TEST_ARTIFACTS") or ROOT / "runs" / "browser-tests")
_SESSION_STARTED = pytest.StashKey[float]()
# The suite runs in two xdist workers (pyproject's addopts: -n 2 --dist loadgroup). Tests that
# share a session-scoped run go to one worker, so each run happens once: the chapters' runs in
# one group, everything that starts Ray in another (the cluster test's `ray stop --force` ends
# every Ray instance on the machine, another worker's included). Tests that share an expensive
# module-scoped fixture go to one worker as well, which builds it once instead of each worker
# building its own (test_vllm's grid of vLLM sizings, about 70 CPU s; test_memory's profiles;
# the compiled steps test_decode's gqa_runs and test_experts_decode's moe_step share).
XDIST_GROUPS = {"cpu_small_run": "runs", "not_ready_run": "runs", "chapter02_sweep": "ray",
                "ray_cluster": "ray", "published": "vllm_published", "grid": "vllm_published",
                "engines": "vllm_engines", "profiles": "memory_profiles", "moe_step": "moe_step",
                "gqa_runs": "gqa_runs"}


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadgroup` whose run ends after a worker dies (tests/crash_safe_scheduling.py)."""
    if config.getvalue("dist") == "loadgroup":
        return CrashSafeLoadGroupScheduling(config, log)
    return None


@pytest.fixture(autouse=True)
def _engine_threads(request):
    """A test that starts vLLM's CPU engine (in this process) runs it on as many threads as
    the worker has cores to itself: two workers of two threads each on two cores made a token
    test 15-25% slower (qwen3 25.5 s against 20.4, under a second process's load). The chapters'
    runs keep every core: near the end of the suite theirs is the one worker still busy."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1)
    if workers == 1 or request.node.get_closest_marker("vllm") is None:
        yield
        return
    import torch
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _older_objects_out_of_gc(request):
    """A test that calls the real vLLM runs with the objects alive before it frozen out of the
    garbage collector's view (`gc.freeze`), and handed back afterwards (`gc.unfreeze`): vLLM
    calls `gc.collect()` six times or more for each engine it starts and stops, and in a worker
    holding the suite's imports, models and compiled graphs each full pass walks all of them.
    Nothing is collected later for it: what was garbage before the test goes back to the oldest
    generation afterwards and is collected there. (test_vllm's engine and token tests in one
    process: 134.5 -> 108.1 CPU s, AVX-512 EPYC under other load.)"""
    if request.node.get_closest_marker("vllm") is None:
        yield
        return
    import gc
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


@pytest.fixture(autouse=True)
def _keep_run_dir_env(monkeypatch):
    """`python -m kit run` sets KIT_RUN_DIR for its kernels; keep that from leaking between tests."""
    monkeypatch.delenv("KIT_RUN_DIR", raising=False)
    yield


@pytest.fixture(scope="session")
def cpu_small_run(tmp_path_factory):
    """Every chapter run once on cpu-small, shared by the notebook, report and browser tests."""
    code, folder = run("cpu-small", out=tmp_path_factory.mktemp("runs"), progress=False)
    return code, json.loads((folder / "summary.json").read_text()), folder


@pytest.fixture(scope="session")
def not_ready_run(tmp_path_factory):
    """A small passing notebook, then chapter 00 on a 32 MiB device: its budget check fails, so
    the run has a failure after a success (for the report) and a real NOT READY verdict."""
    fixture = Path(__file__).parent / "fixtures" / "passing.ipynb"
    code, folder = run("cpu-small", [str(fixture), "00"], {"device_memory": "32MiB"},
                       out=tmp_path_factory.mktemp("runs"), progress=False)
    return code, json.loads((folder / "summary.json").read_text()), folder


@pytest.fixture(scope="session")
def chapter02_sweep(tmp_path_factory):
    """`python -m kit sweep 02 --grid block_size=16,32 --grid kv_cache_dtype=auto,fp8
    --parallel 2` on a local Ray instance, shared by the sweep and browser tests."""
    from kit.sweep.driver import sweep
    return sweep("cpu-small", ["02"], ["block_size=16,32", "kv_cache_dtype=auto,fp8"],
                 parallel=2, out=tmp_path_factory.mktemp("sweeps"), progress=False)


@pytest.fixture
def artifact(request):
    """artifact("name.png") -> a path under ARTIFACTS, listed at the end of the test session."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    return lambda name: ARTIFACTS / name


def pytest_configure(config):
    config.stash[_SESSION_STARTED] = time.time()


def join_group(item, group: str) -> None:
    """What `--dist loadgroup` schedules by: a `@group` suffix on the node id. xdist 3.8 writes
    it to `item._nodeid`, which pytest 9.2 no longer reads (the id lives in `item._id`), so no
    test was grouped; the suffix is set here for both."""
    name = f"{item.nodeid}@{group}"
    if hasattr(item, "_id"):
        from _pytest.nodeid import coerce_node_id
        item._id = coerce_node_id(name)
    else:
        item._nodeid = name


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """A test that uses a headless run of notebooks is slow, whatever its module; under xdist a
    test that uses a shared run, Ray or an expensive module fixture joins that group
    (XDIST_GROUPS, or its own `xdist_group` mark)."""
    for item in items:
        used = set(getattr(item, "fixturenames", ()))
        if {"cpu_small_run", "not_ready_run", "chapter02_sweep"} & used:
            item.add_marker(pytest.mark.slow)
        groups = {XDIST_GROUPS[f] for f in used & XDIST_GROUPS.keys()}
        groups |= {m.args[0] for m in item.iter_markers("xdist_group")}
        assert len(groups) <= 1, f"{item.nodeid} needs runs of two xdist groups: {groups}"
        if groups and getattr(config.option, "loadgroup", False):  # set in xdist's workers
            join_group(item, groups.pop())


def pytest_terminal_summary(terminalreporter, config):
    """The artifacts written during this session (by whichever worker), named at the end."""
    if not ARTIFACTS.is_dir() or hasattr(config, "workerinput"):
        return
    started = config.stash[_SESSION_STARTED]
    written = sorted(p for p in ARTIFACTS.iterdir() if p.is_file() and p.stat().st_mtime >= started)
    if written:
        terminalreporter.write_sep("-", f"test artifacts in {ARTIFACTS}")
        for p in written:
            terminalreporter.write_line(f"  {p.name}")

