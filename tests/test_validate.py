"""`python -m kit validate`, the prepared GPU validation run, exercised on the CPU: its steps
run for real here on cpu-small (the GPU's own claims are only checked on a GPU), its refusal of
the gpu preset without a GPU, and its time limit."""
import json
import subprocess
import sys

import pytest
import torch

from kit.cli.validate import STEPS, validate_gpu


def kit(*args):
    return subprocess.run([sys.executable, "-m", "kit", *args], capture_output=True, text=True)


def test_steps_run_and_summary_says_what_held(tmp_path):
    status, folder = validate_gpu("cpu-small", [], tmp_path, only=["machine", "probe"])
    summary = json.loads((folder / "summary.json").read_text())
    assert status == 0
    assert [s["step"] for s in summary["steps"]] == ["machine", "probe"]
    probe = next(s for s in summary["steps"] if s["step"] == "probe")
    assert probe["ok"] and probe["held"] and all(h["ok"] for h in probe["held"])
    assert json.loads((folder / "probe.json").read_text())["probe"]["67108864"] == 64 * 2**20
    md = (folder / "summary.md").read_text()
    assert "2 of 2 steps held" in md and "measures exactly 64 MiB" in md


def test_out_of_time_is_reported_not_hidden(tmp_path):
    status, folder = validate_gpu("cpu-small", [], tmp_path, limit_seconds=2, only=["machine"])
    step = json.loads((folder / "summary.json").read_text())["steps"][0]
    assert status == 1 and not step["ok"] and step["error"] == "no time left"


def test_unknown_step_is_refused_before_any_work(tmp_path):
    out = kit("validate", "--preset", "cpu-small", "--only", "nope", "--out", str(tmp_path))
    assert out.returncode == 2 and "unknown steps ['nope']" in out.stderr
    assert not any(tmp_path.iterdir())


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_gpu_preset_without_a_gpu_says_so():
    out = kit("validate")
    assert out.returncode == 2
    assert "no CUDA device" in out.stderr and "Traceback" not in out.stderr


def test_chapters_come_last_and_every_step_has_a_share():
    names = [s.name for s in STEPS]
    assert names[-1] == "chapters" and names[:2] == ["machine", "probe"]
    assert all(s.max_seconds > 0 for s in STEPS)
