import ast
import json
from pathlib import Path

import nbformat
import pytest

import kit
from kit.errors import ConfigError
from kit.cli.main import main
from kit.execute.notebooks import find_notebooks, parse_params, run

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.mark.slow
def test_broken_notebook_is_reported_and_the_others_still_run(tmp_path, capsys):
    notebooks = [str(FIXTURES / "broken.ipynb"), str(FIXTURES / "passing.ipynb")]
    code, folder = run("cpu-small", notebooks, out=tmp_path, progress=False)
    assert code == 1
    summary = json.loads((folder / "summary.json").read_text())
    broken, passing = summary["notebooks"]
    # cell 3 of the executed copy: papermill inserts the injected parameters as cell 1
    assert not broken["ok"] and broken["error"]["cell_index"] == 3
    assert broken["error"]["source"] == 'raise RuntimeError("deliberately broken")'
    assert broken["error"]["ename"] == "RuntimeError" and "deliberately broken" in broken["error"]["evalue"]
    assert broken["recorded"]["results"] == {"before_the_error": 1}  # kept despite the error
    executed = nbformat.read(folder / "broken.ipynb", as_version=4)
    assert any(o.get("ename") == "RuntimeError" for c in executed.cells for o in c.get("outputs", []))
    assert passing["ok"] and passing["checks_passed"] > 0 and not passing["checks_failed"]
    assert (folder / "passing.json").is_file()
    out = capsys.readouterr().out
    assert "cell 3: RuntimeError: deliberately broken" in out
    # the run's report shows the failing cell (kit/report.py; tests/test_report.py for more)
    assert f"report: {folder / 'report.html'}" in out
    assert "<pre>raise RuntimeError(&quot;deliberately broken&quot;)</pre>" in (folder / "report.html").read_text()


@pytest.mark.slow
def test_failed_check_fails_the_run_and_is_named(tmp_path):
    code, folder = run("cpu-small", [str(FIXTURES / "failing_check.ipynb")], out=tmp_path,
                       progress=False)
    status = json.loads((folder / "summary.json").read_text())["notebooks"][0]
    assert code == 1 and status["checks_failed"] == ["one equals two"] and status["checks_passed"] == 1


def test_unknown_parameter_refused_before_anything_runs(tmp_path, capsys):
    assert main(["run", "00", "-p", "colour=red", "--out", str(tmp_path)]) == 2
    assert "unknown parameter(s) ['colour']" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_bad_value_refused_before_anything_runs(tmp_path, capsys):
    assert main(["run", "01", "-p", "gpu_memory_utilization=2", "--out", str(tmp_path)]) == 2
    assert "must be in (0, 1]" in capsys.readouterr().err
    assert main(["run", "--preset", "nope", "--out", str(tmp_path)]) == 2
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_runs_never_overwrite_each_other(tmp_path):
    _, a = run("cpu-small", [str(FIXTURES / "failing_check.ipynb")], out=tmp_path, progress=False)
    _, b = run("cpu-small", [str(FIXTURES / "failing_check.ipynb")], out=tmp_path, progress=False)
    assert a != b and a.is_dir() and b.is_dir()


def test_parse_params_and_notebook_names():
    assert parse_params(["a=1", "b=0.5", "c=cpu", "d=None", "e=[1, 2]"]) == \
        {"a": 1, "b": 0.5, "c": "cpu", "d": None, "e": [1, 2]}
    with pytest.raises(ConfigError, match="NAME=VALUE"):
        parse_params(["oops"])
    assert [p.stem for p in find_notebooks(["01"])] == ["01_memory_profiling"]
    with pytest.raises(ConfigError, match="unknown notebook '99'"):
        find_notebooks(["99"])


NOISE = ["USDT", "Kernel is running over TCP", "C-level stdout noise", "C-level stderr noise",
         "noise from a subprocess"]


@pytest.mark.slow
def test_the_terminal_stays_quiet_and_the_noise_goes_to_the_log(tmp_path, capfd):
    """Chapter 02 (torch.profiler prints USDT lines at C level) and a notebook that writes to
    its file descriptors and starts a subprocess that does: none of it on the terminal (stdout
    is not one here: plain lines), all of it in the log that summary.json and the report name."""
    code, folder = run("cpu-small", [str(FIXTURES / "noisy.ipynb"), "02"], out=tmp_path)
    out, err = capfd.readouterr()
    assert code == 0 and not any(noise in out + err for noise in NOISE)
    assert "\r" not in out and err == ""
    assert "[1/2] noisy ...\n[1/2] noisy: ok in " in out and "[2/2] 02_kv_cache: ok in " in out
    summary = json.loads((folder / "summary.json").read_text())
    log = (folder / summary["log"]).read_text()
    assert summary["log"] == "kernel.log" and log.count("Kernel is running over TCP") == 2
    assert all(noise in log for noise in NOISE[2:])
    assert "[cell 3] hello from the notebook" in log  # what the notebook printed, by cell
    assert "02_kv_cache: 16/16 checks passed" in log
    # the kernel imports the kit that runs it, even with another checkout installed in the venv
    assert f"kit imported from {Path(kit.__file__)}" in log
    assert 'href="kernel.log"' in (folder / "report.html").read_text()


@pytest.mark.slow
def test_verbose_puts_the_noise_on_the_terminal_as_well(tmp_path, capfd):
    code, folder = run("cpu-small", [str(FIXTURES / "noisy.ipynb")], out=tmp_path, verbose=True)
    err = capfd.readouterr().err
    assert code == 0 and all(noise in err for noise in NOISE[1:])
    assert all(noise in (folder / "kernel.log").read_text() for noise in NOISE[1:])


@pytest.mark.slow
def test_a_kernel_that_dies_is_reported_and_the_next_notebook_runs(tmp_path, capsys):
    notebooks = [str(FIXTURES / "dies.ipynb"), str(FIXTURES / "passing.ipynb")]
    code, folder = run("cpu-small", notebooks, out=tmp_path, progress=False)
    dies, passing = json.loads((folder / "summary.json").read_text())["notebooks"]
    assert code == 1 and not dies["ok"] and dies["error"]["ename"] == "DeadKernelError"
    assert passing["ok"]
    assert "[1/2] dies: FAILED in " in capsys.readouterr().out
    assert "Kernel died" in (folder / "kernel.log").read_text()  # nbclient's error, logged


@pytest.mark.slow
def test_bench_suite_writes_seconds_per_chapter(tmp_path, capsys):
    """On a notebook named by its path (a chapter is named as `kit run` names it); the suite's
    real chapters are timed by the suite's shared run."""
    out = tmp_path / "suite.json"
    code = main(["bench", "suite", str(FIXTURES / "passing.ipynb"), "--runs", str(tmp_path),
                 "--out", str(out), "--no-progress"])
    result = json.loads(out.read_text())
    assert code == 0 and result["ok"] and not result["whole_suite"]
    chapter = result["chapters"]["passing"]
    assert chapter["seconds"] > 0 and chapter["checks_passed"] == 1
    assert result["total_seconds"] >= chapter["seconds"]
    assert result["inductor_cache"]["state"] in ("cold", "warm")
    summary = json.loads((Path(result["run_folder"]) / "summary.json").read_text())
    assert result["machine"] == summary["machine"]
    assert result["target"] == {"cold_seconds": 300, "warm_seconds": 150,
                                "machine": "2-core CPU without native bf16", "within": None}
    printed = capsys.readouterr().out
    assert "passing" in printed and "\ntotal " in printed and f"wrote {out}" in printed
    assert "300 s with cold compile caches, 150 s warm" in printed


def test_the_machine_section_gathers_what_chapters_measured():
    from kit.execute.notebooks import add_measured_hardware
    from kit.measure.dtype_speed import hardware_figures
    from kit.results import plain
    chapters = {}
    for name, copy, rates in (("00", 30e9, {"float32": 70e9, "bfloat16": 1e9}),
                              ("04", 20e9, {"bfloat16": 2e9, "float32": 70e9})):
        units = {}
        chapters[name] = {"results": plain({"hardware": hardware_figures(copy, rates)}, units),
                          "units": units}
    ch00, ch04 = chapters["00"], chapters["04"]
    assert ch00["results"]["hardware"] == {"copy_GB_per_s": 30.0,
                                           "matmul_GFLOP_per_s.float32": 70.0,
                                           "matmul_GFLOP_per_s.bfloat16": 1.0,
                                           "speed_vs_float32.bfloat16": 1 / 70}
    assert ch04["results"]["hardware"]["speed_vs_float32.bfloat16"] == 2 / 70
    machine, units = {"device": "cpu"}, {}
    add_measured_hardware(machine, units, "02_kv_cache", {"results": {"num_blocks": 3}})
    assert "measured" not in machine and not units  # no hardware measured, nothing added
    add_measured_hardware(machine, units, "00_setup_check", ch00)
    add_measured_hardware(machine, units, "04_decode_timing", ch04)
    assert machine["measured"]["measured_by"] == "00_setup_check"
    assert machine["measured"]["speed_vs_float32.bfloat16"] == 1 / 70  # the first one kept
    assert units == {"machine.measured.copy_GB_per_s": "GB/s",
                     "machine.measured.matmul_GFLOP_per_s.float32": "GFLOP/s",
                     "machine.measured.matmul_GFLOP_per_s.bfloat16": "GFLOP/s",
                     "machine.measured.speed_vs_float32.bfloat16": "ratio"}
    machine = {}
    add_measured_hardware(machine, {}, "04_decode_timing", ch04)  # a run without chapter 00
    assert machine["measured"]["matmul_GFLOP_per_s.bfloat16"] == 2.0


def test_bench_suite_says_whether_this_cpus_bf16_is_native():
    from kit.cli.suite import bf16_line
    slow = {"cpu_isa": {"pytorch_kernels": "AVX2"},
            "measured": {"speed_vs_float32.bfloat16": 1 / 80}}
    assert bf16_line(slow) == ("PyTorch's kernels AVX2; bf16 matmuls emulated, "
                               "at 0.01× float32's FLOP/s")
    fast = {"cpu_isa": {"pytorch_kernels": "AVX512"},
            "measured": {"speed_vs_float32.bfloat16": 2.0}}
    assert "native, at 2.00×" in bf16_line(fast)
    older = {"cpu_isa": {"pytorch_kernels": "AVX2"},  # recorded before the rename
             "measured": {"slowdown_vs_float32.bfloat16": 80.0}}
    assert bf16_line(older) == bf16_line(slow)
    assert "not measured" in bf16_line({"cpu_isa": {"pytorch_kernels": "AVX512"}})


# What opens a CUDA context (or needs one): the kit's device functions, and torch.cuda's but
# the two that only ask the driver (`is_available`, `device_count`: cuInit, no context).
OPENS_A_CONTEXT = {"describe", "describe_in_child", "capacity_bytes", "cuda_usage",
                   "synchronize", "run_probes", "build_model"}
ASKS_THE_DRIVER = {"is_available", "device_count"}
# The modules that run in `python -m kit run`'s, `kit sweep`'s and `kit bench suite`'s own
# process, while notebooks' kernels measure the card.
PARENT = ["kit/execute/*.py", "kit/pages/*.py", "kit/sweep/*.py", "kit/cli/main.py",
          "kit/cli/suite.py", "kit/results.py", "kit/config/*.py"]


def test_the_parent_process_never_opens_a_cuda_context():
    """The parent of the notebooks' kernels calls nothing that opens a CUDA context (a context
    held for the whole run costs about 0.5 GB of the card the chapters measure): the machine is
    described through `describe_apart`, which asks a child process on CUDA."""
    root = Path(kit.__file__).parent.parent
    calls = []
    for path in sorted({p for pattern in PARENT for p in root.glob(pattern)}):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                name = ast.unparse(node.func)
                last = name.rsplit(".", 1)[-1]
                cuda = "torch.cuda." in name and last not in ASKS_THE_DRIVER
                if last in OPENS_A_CONTEXT or cuda:
                    calls.append(f"{path.relative_to(root)}: {name}")
    assert calls == []
    source = (root / "kit/execute/notebooks.py").read_text()
    assert "describe_apart(settings.device" in source
