"""`python -m kit sweep`: grids refused before Ray starts, the points run as Ray tasks (a local
instance; a two-node cluster on 127.0.0.1, where a failed point is recorded and resumed), the
page.

The chapter 02 sweep itself is the session fixture `chapter02_sweep` (conftest.py), shared with
the browser test of its page."""
import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from kit.errors import ConfigError
from kit.sweep import grid
from kit.execute.notebooks import find_notebooks
from kit.pages.sweep_page import at_once, curve_lines, render, pr_series, varying_numbers

FIXTURES = Path(__file__).parent / "fixtures"
POINT = str(FIXTURES / "sweep_point.ipynb")  # takes seed and batch_size; fails on request


# ------------------------------------------------------------------ the grid, before anything runs

def test_grid_values_parse_as_literals_or_words():
    assert grid.parse_values("512,1024") == [512, 1024]
    assert grid.parse_values("float32,bfloat16") == ["float32", "bfloat16"]
    assert grid.parse_values("96MiB, 2GiB") == ["96MiB", "2GiB"]
    assert grid.parse_values("'eager,stock','eager'") == ["eager,stock", "eager"]
    assert grid.parse_values("1,None,fp8") == [1, None, "fp8"]
    assert grid.parse_grid(["a=1,2", "b=x"]) == {"a": [1, 2], "b": ["x"]}
    points = grid.expand({"a": [1, 2], "b": ["x", "y"]})
    assert points == [{"a": 1, "b": "x"}, {"a": 1, "b": "y"}, {"a": 2, "b": "x"},
                      {"a": 2, "b": "y"}]
    assert grid.point_name(3, {"device_memory": "96MiB", "dtype": "float32"}) == \
        "03-device_memory=96MiB-dtype=float32"
    assert grid.point_name(1, {"x": "a/b c"}) == "01-x=a_b_c"


@pytest.mark.parametrize("pairs, message", [
    (["block_size"], "write NAME=V1,V2"),
    (["block_size="], "write NAME=V1,V2"),
    (["block_size=16,,32"], "an empty value"),
    (["block_size=16,16"], "the value 16 is given twice"),
    (["block_size=16", "block_size=32"], "block_size given twice"),
])
def test_malformed_grids_are_refused(pairs, message):
    with pytest.raises(ConfigError, match=message):
        grid.parse_grid(pairs)


@pytest.mark.parametrize("grid_, fixed, message", [
    ({}, {}, "the grid is empty"),
    ({"colour": ["red", "blue"]}, {}, r"unknown parameter\(s\) \['colour'\]"),
    ({"num_iters": [1, 2]}, {}, r"unknown parameter\(s\) \['num_iters'\]"),  # not chapter 02's
    ({"block_size": [16, 32]}, {"colour": 1}, r"unknown parameter\(s\) \['colour'\]"),
    ({"gpu_memory_utilization": [0.5, 2]}, {}, r"gpu_memory_utilization=2 is refused: .*\(0, 1\]"),
    ({"kv_cache_dtype": ["auto", "fp4"]}, {}, "kv_cache_dtype='fp4' is refused"),
    ({"block_size": [16, 32]}, {"block_size": 16}, "given both as --grid and as -p"),
    ({"preset": ["cpu-small", "cpu-real"]}, {}, "run one sweep per preset"),
])
def test_bad_grids_are_refused_naming_the_parameter(grid_, fixed, message):
    with pytest.raises(ConfigError, match=message):
        grid.check("cpu-small", find_notebooks(["02"]), grid_, fixed)


def test_large_grids_need_yes():
    big = {"block_size": [16, 32, 64, 128], "max_model_len": [256, 512, 1024],
           "gpu_memory_utilization": [0.5, 0.6, 0.7]}
    with pytest.raises(ConfigError, match="36 points .* more than 32: add --yes"):
        grid.check("cpu-small", find_notebooks(["02"]), big, {})
    assert len(grid.check("cpu-small", find_notebooks(["02"]), big, {}, yes=True)) == 36
    assert len(grid.check("cpu-small", find_notebooks(["02"]), big, {}, max_points=40)) == 36


def test_the_command_refuses_before_ray_starts(tmp_path, capsys):
    """Exit status 2, the parameter named, no sweep folder, and Ray never imported."""
    code = ("import sys; from kit.cli.main import main; "
            "code = main(sys.argv[1:]); assert 'ray' not in sys.modules; sys.exit(code)")
    cases = [(["02", "--grid", "colour=red,blue"], "unknown parameter(s) ['colour']"),
             (["02", "--grid", "block_size=16,32", "-p", "gpu_memory_utilization=2"],
              "must be in (0, 1]"),
             (["02"], "the grid is empty"),
             (["02", "--preset", "nope", "--grid", "block_size=16"], "unknown preset 'nope'"),
             (["02", "--grid", "block_size=16,32", "--max-points", "1"], "add --yes"),
             (["02", "--grid", "block_size=16", "--parallel", "0"], "--parallel 0"),
             (["--resume", str(tmp_path)], "is not a sweep folder")]
    for args, message in cases:
        done = subprocess.run([sys.executable, "-c", code, "sweep", *args, "--out",
                               str(tmp_path)], capture_output=True, text=True)
        assert done.returncode == 2 and message in done.stderr, (args, done.stderr)
        assert "Traceback" not in done.stderr
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------ the page's arithmetic

def fake_sweep(results: dict[tuple, dict], grid_: dict, times=None) -> dict:
    names = list(grid_)
    points = []
    for i, (values, res) in enumerate(results.items(), 1):
        started, ended = (times or {}).get(values, (None, None))
        points.append({"index": i, "name": f"{i:02d}", "parameters": dict(zip(names, values)),
                       "status": "ok", "results": res, "started": started, "ended": ended})
    return {"preset": "cpu-small", "notebooks": ["x/01_memory_profiling.ipynb"], "grid": grid_,
            "fixed": {}, "runs": [], "points": points}


def test_page_arithmetic_lines_concurrency_and_the_pr_curve(tmp_path):
    grid_ = {"max_num_batched_tokens": [512, 1024], "device_memory": ["96MiB", "2GiB"]}
    blocks = {(512, "96MiB"): (10, 12), (512, "2GiB"): (500, 502),
              (1024, "96MiB"): (8, 11), (1024, "2GiB"): (498, 501)}
    results = {k: {"01_memory_profiling.kv_blocks.eager": e,
                   "01_memory_profiling.kv_blocks.compiled": c,
                   "01_memory_profiling.weights_bytes": 5} for k, (e, c) in blocks.items()}
    times = {(512, "96MiB"): (0, 10), (512, "2GiB"): (5, 15), (1024, "96MiB"): (20, 30),
             (1024, "2GiB"): (21, 22)}
    s = fake_sweep(results, grid_, times)
    assert [at_once(p, s["points"]) for p in s["points"]] == [2, 2, 2, 2]
    for p, host in zip(s["points"], ["a", "b", "a", "a"]):
        p["node"] = {"node_id": host * 8, "hostname": host, "ip": "10.0.0.1"}
    assert [at_once(p, s["points"], same_machine=True) for p in s["points"]] == [1, 1, 2, 2]
    assert at_once({"started": 100, "ended": 101}, s["points"] + [{"started": 100, "ended": 101}]) == 1
    assert list(varying_numbers(s["points"])) == ["01_memory_profiling.kv_blocks.eager",
                                                  "01_memory_profiling.kv_blocks.compiled"]
    lines = curve_lines(s, "01_memory_profiling.kv_blocks.eager", "max_num_batched_tokens")
    assert lines == [("device_memory=96MiB", [512, 1024], [10, 8], ["01", "03"]),
                     ("device_memory=2GiB", [512, 1024], [500, 498], ["02", "04"])]
    assert pr_series(s) == [("device_memory=96MiB", [512, 1024], [10, 8], [12, 11]),
                              ("device_memory=2GiB", [512, 1024], [500, 498], [502, 501])]
    (tmp_path / "sweep.json").write_text(json.dumps(s))
    page = render(tmp_path)
    assert "The PR&#x27;s curve" in page or "The PR's curve" in page
    # one figure per varying number and swept parameter, plus the PR's curve
    assert page.count('class="figure kit-figure') == 2 * 2 + 1


# ------------------------------------------------------------------ sweeps that run

@pytest.mark.slow
def test_chapter02_sweep_on_a_local_ray_instance(chapter02_sweep):
    """2 block sizes × 2 KV cache dtypes of chapter 02: every point an ordinary run folder, the
    numbers in sweep.json, and they move as the arithmetic says they must."""
    code, folder = chapter02_sweep
    s = json.loads((folder / "sweep.json").read_text())
    assert code == 0 and [p["status"] for p in s["points"]] == ["ok"] * 4
    assert s["runs"][0]["address"] == "local" and s["runs"][0]["parallel"] == 2
    by = {(p["parameters"]["block_size"], p["parameters"]["kv_cache_dtype"]): p["results"]
          for p in s["points"]}
    for p in s["points"]:
        run = folder / p["folder"]
        summary = json.loads((run / "summary.json").read_text())
        assert summary["parameters"] == p["parameters"]
        assert (run / "report.html").is_file() and (run / "02_kv_cache.ipynb").is_file()
        assert p["notebooks"][0]["checks_failed"] == [] and p["notebooks"][0]["checks_passed"] > 0
        assert p["node"]["node_id"] and p["seconds"] > 0
        log = (run / "sweep-point.log").read_text()  # names the point's folder, not a gone one
        assert "report: ./report.html" in log and "kit-sweep-" not in log, log[-500:]
    ran = s["runs"][0]  # the wall time holds Ray's start and stop: more than the points'
    assert ran["ended"] - ran["started"] > max(p["ended"] for p in s["points"]) - \
        min(p["started"] for p in s["points"])
    per_block = {k: r["02_kv_cache.bytes_per_block"] for k, r in by.items()}
    assert per_block[32, "auto"] == 2 * per_block[16, "auto"]
    assert per_block[16, "auto"] == 2 * per_block[16, "fp8"]  # bf16 -> one byte
    for k, r in by.items():
        assert r["02_kv_cache.num_blocks"] == r["02_kv_cache.budget_bytes"] // per_block[k]
    page = (folder / "sweep.html").read_text()
    assert "All 4 points ran ok" in page and "02_kv_cache" in page
    assert "every other parameter at the preset's value" in page
    # block_size takes powers of two: its figures have a log-2 axis with a tick per value
    figure = re.search(r'"xaxis":\{[^}]*"title":\{"text":"block_size"\}[^}]*\}', page)
    assert figure and '"type":"log"' in figure.group(0) and '"tickvals":[16,32]' in figure.group(0)


@pytest.fixture
def ray_cluster(tmp_path):
    """A head and one worker node, both on 127.0.0.1, one CPU each (token authentication, as
    Ray 2.60 requires for a node to join), started with KIT_FIXTURE_FAIL naming a file that
    the fixture notebook reads (empty: no point fails); stopped afterwards."""
    ray = str(Path(sys.executable).parent / "ray")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    fail = tmp_path / "fail"
    fail.write_text("")
    env = {**os.environ, "RAY_AUTH_MODE": "token", "KIT_FIXTURE_FAIL": str(fail)}
    common = ["--num-cpus=1", "--node-ip-address=127.0.0.1", "--disable-usage-stats"]
    try:
        subprocess.run([ray, "start", "--head", f"--port={port}", "--include-dashboard=false",
                        *common], env=env, check=True, capture_output=True, timeout=120)
        subprocess.run([ray, "start", f"--address=127.0.0.1:{port}", *common], env=env,
                       check=True, capture_output=True, timeout=120)
        yield f"127.0.0.1:{port}", env, fail
    finally:
        subprocess.run([ray, "stop", "--force"], env=env, capture_output=True, timeout=120)


def kit_sweep(env, *args):
    return subprocess.run([sys.executable, "-m", "kit", "sweep", *args, "--no-progress"],
                          env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_a_failed_point_on_a_two_node_cluster_is_recorded_and_resume_finishes_it(ray_cluster,
                                                                                 tmp_path):
    """Three points on two nodes, the one with seed 2 failing at run time: recorded with its
    error and its run folder, listed first on the page, the resume command printed. Resumed on
    the same cluster, only the failed point and one whose folder went missing run again."""
    address, env, fail = ray_cluster
    fail.write_text("2")  # the point with seed 2 raises
    done = kit_sweep(env, POINT, "--grid", "seed=1,2,3", "-p", "batch_size=4", "--address",
                     address, "--parallel", "2", "--out", str(tmp_path))
    assert done.returncode == 1, done.stdout + done.stderr
    folder = next(tmp_path.glob("sweep-*"))
    s = json.loads((folder / "sweep.json").read_text())
    assert s["runs"][0]["nodes"] == 2 and s["runs"][0]["address"] == address
    assert len({p["node"]["node_id"] for p in s["points"]}) == 2  # both nodes ran points
    assert [p["status"] for p in s["points"]] == ["ok", "failed", "ok"]
    failed = s["points"][1]
    assert "RuntimeError: point with seed=2 fails on purpose" in failed["error"]
    for p in s["points"]:  # every run folder shipped back from its node, the failed one's too
        assert (folder / p["folder"] / "sweep_point.ipynb").is_file()
        assert (folder / p["folder"] / "report.html").is_file()
    page = (folder / "sweep.html").read_text()
    assert "1 of 3 points did not finish ok" in page and "fails on purpose" in page
    assert page.index(failed["name"]) < page.index(s["points"][0]["name"])  # failed first
    assert "on node" in done.stdout and "2/3 points ok" in done.stdout
    assert f"--resume {folder}" in done.stdout
    shutil.rmtree(folder / s["points"][2]["folder"])  # a point gone missing
    kept = (folder / s["points"][0]["folder"] / "summary.json").stat().st_mtime_ns

    fail.write_text("")
    done = kit_sweep(env, "--resume", str(folder), "--address", address, "--parallel", "2")
    assert done.returncode == 0, done.stdout + done.stderr
    s = json.loads((folder / "sweep.json").read_text())
    assert [p["status"] for p in s["points"]] == ["ok"] * 3 and "3/3 points ok" in done.stdout
    assert [p["attempts"] for p in s["points"]] == [1, 2, 2]  # only the failed and the missing
    assert (folder / s["points"][0]["folder"] / "summary.json").stat().st_mtime_ns == kept
    assert len(s["runs"]) == 2
    assert [p["results"]["sweep_point.product"] for p in s["points"]] == [4, 8, 12]
