import pytest
import torch

from kit.config import load
from kit.errors import ConfigError
from kit.measure.device import capacity_bytes, physical_memory_bytes
from kit.measure.memory import probe_measurement
from kit.engine.profile_run import check_fits, no_kv_cache_message, profile_memory
from kit.units import GiB


@pytest.fixture(scope="module")
def profiles():
    return profile_memory(load("cpu-small", max_num_batched_tokens=512, device="cpu"))


def test_eager_and_compiled_are_both_measured(profiles):
    assert set(profiles) == {"eager", "compiled"}
    for p in profiles.values():
        assert p.peak_activation_bytes > 0 and len(p.timeline_bytes) > 0
        assert max(p.timeline_bytes) == p.peak_activation_bytes  # the CPU peak is the timeline's
        # the timeline is time within the forward, not the compile or the model's build; the
        # profiler's clock is not perf_counter's and its first event may precede the timer by
        # a fraction of a millisecond (seen once: 69.72 ms of timeline in a 69.43 ms forward)
        assert 0 <= p.timeline_ms[0] <= p.timeline_ms[-1] <= p.forward_seconds * 1e3 + 1
    assert profiles["compiled"].compile_seconds > 0 and profiles["eager"].compile_seconds == 0


def test_peak_covers_weights_input_and_real_activations(profiles):
    s = load("cpu-small")
    for p in profiles.values():
        assert p.num_tokens == 512 and p.input_bytes == 512 * 8
        assert p.weights_bytes == s.arch.num_parameters() * 2
        assert p.peak_bytes >= p.weights_bytes + p.input_bytes
        # Compiled or not, the MLP's [tokens, intermediate] tensor must be live at some point:
        # this fails if the measurement misses buffers that Inductor's code allocates.
        assert p.peak_activation_bytes >= 512 * s.arch.intermediate_size * 2


def test_kv_budget_arithmetic_and_capacity_override(profiles):
    for p in profiles.values():
        assert p.capacity_bytes == 96 * 2**20  # the preset's device_memory, not physical memory
        assert p.budget_bytes == int(96 * 2**20 * 0.9)
        assert p.kv_cache_bytes == p.budget_bytes - p.weights_bytes - p.peak_activation_bytes
        assert p.non_torch_bytes is None  # not measured on the CPU


def test_capacity_defaults_to_physical_memory():
    assert capacity_bytes("cpu") == physical_memory_bytes()
    assert capacity_bytes("cpu", 16 * GiB) == 16 * GiB


def test_weights_larger_than_budget_refused_before_loading():
    with pytest.raises(ConfigError, match=r"GiB missing. Raise device_memory"):
        check_fits(load("cpu-small", model="llama-3.1-8b", device_memory="8GiB"))


def test_no_kv_cache_message_says_what_is_missing(profiles):
    p = profiles["eager"]
    p = type(p)(**{**p.__dict__, "capacity_bytes": p.weights_bytes})  # budget below weights
    assert p.kv_cache_bytes < 0
    msg = no_kv_cache_message(p)
    assert msg.startswith("No available memory for the cache blocks") and "GiB short" in msg


def test_probe_measurement_is_exact():
    assert probe_measurement("cpu", 8 * 2**20) == 8 * 2**20


def test_outputs_of_compiled_profile_model_match_eager():
    from kit.engine.model import build_model, dummy_batch
    s = load("cpu-small", dtype="float32")
    model = build_model(s.arch, s.dtype, "cpu")
    ids = dummy_batch(64, 4, s.arch.vocab_size, "cpu")
    with torch.inference_mode():
        torch.testing.assert_close(torch.compile(model.forward)(ids), model(ids),
                                   atol=1e-4, rtol=1e-4)
    torch._dynamo.reset()


def test_the_profiler_says_nothing_on_stderr():
    """torch.profiler prints `USDT: ... profiler_start/stop` on file descriptor 2 (JupyterLab
    shows it as an error); `profiled` keeps those quiet and what the code prints in between."""
    import subprocess
    import sys
    code = ("import os, torch\n"
            "from kit.measure.profiler import profiled\n"
            "with profiled('cpu') as prof:\n"
            "    torch.ones(8).sum()\n"
            "    os.write(2, b'inside\\n')\n"
            "os.write(2, b'after\\n')\n"
            "assert prof.key_averages()\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stderr == "inside\nafter\n"


def test_c_level_stderr_is_captured_for_one_block_and_handed_back():
    """`fd2_captured(lines)`: what C code writes to descriptor 2 inside the block (vLLM's CPU
    worker warns there at each engine start) comes back as lines, even when the block raises;
    before and after, the descriptor is the process's own."""
    import subprocess
    import sys
    code = ("import os\n"
            "from kit.measure.fd_capture import fd2_captured\n"
            "os.write(2, b'before\\n')\n"
            "lines = []\n"
            "try:\n"
            "    with fd2_captured(lines):\n"
            "        os.write(2, b'one\\ntwo\\n')\n"
            "        raise KeyError('inside')\n"
            "except KeyError:\n"
            "    pass\n"
            "with fd2_captured():\n"
            "    os.write(2, b'dropped\\n')\n"
            "os.write(2, b'after\\n')\n"
            "print(lines)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stderr == "before\nafter\n" and done.stdout == "['one', 'two']\n"


def test_every_profile_warms_cublas_up_before_its_baseline(monkeypatch):
    """cuBLAS's workspaces belong in a profile's baseline, not in the peak of whichever profile
    ran the first product: chapter 01's profile, chapter 03's plan profile and chapter 04's
    budget fallback each warm cuBLAS up (`warm_up_blas`), then measure. Only the order is
    checked here; the bytes it keeps out of the eager peak show on a GPU alone."""
    from kit.engine import profile_run as run
    from kit.engine.decode_fit import decode_budget
    from kit.engine.kv_cache import KVCacheLayout
    from kit.engine.model import build_model
    from kit.studies.compile_strategies import PLANS, PlanResult, _Bench, _profile
    calls, warm, measure = [], run.warm_up_blas, run.measure_allocations

    def warm_up_blas(*args):
        calls.append("warm")
        return warm(*args)

    def measure_allocations(*args, **kwargs):
        calls.append("measure")
        return measure(*args, **kwargs)
    monkeypatch.setattr(run, "warm_up_blas", warm_up_blas)
    monkeypatch.setattr(run, "measure_allocations", measure_allocations)
    s = load("cpu-small", max_num_batched_tokens=256, device="cpu")
    with torch.inference_mode():
        run.profile_memory(s, {"eager": "eager"})
        bench = _Bench(s, KVCacheLayout.for_model(s.arch, s.block_size, s.dtype), [1, 2])
        _profile(bench, PLANS[0], PlanResult(1, "eager", "eager", "eager", False, ""))
    decode_budget(s, build_model(s.arch, s.dtype, "cpu", s.seed))
    assert calls == ["warm", "measure"] * 3
