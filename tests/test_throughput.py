"""The time-bounded probes (kit.measure.throughput), the CPU's ISA as PyTorch sees it, the
compilers chapter 00 looks for, and the 16-bit speed verdict chapters 00, 03–05 print. Real
measurements on this machine: the tests check what must hold on any machine (sizes within
limits, enough repeats, positive rates), never how fast it is."""
import json
import subprocess
import sys

import pytest
import torch

from kit.measure import throughput
from kit.execute.notebooks import kernel_env
from kit.measure.device import cpu_isa, describe, describe_apart, describe_in_child
from kit.measure.dtype_speed import (SLOW_FACTOR, DtypeSpeed, dtype_note, dtype_speed_here,
                                     dtype_speeds, speed_finding)
from kit.measure.timing import Timings
from kit.studies.setup_check import compilers, fix_for
from kit.units import fmt_flops


def test_copy_probe_sizes_itself_within_its_limit():
    t = throughput.copy_bandwidth("cpu", budget=0.3)
    assert 2**20 <= t.size <= throughput.COPY_LIMIT["cpu"] and t.size % 2**20 == 0
    assert t.work == 2 * t.size and t.rate > 0
    assert len(t.timings.seconds) >= throughput.MIN_REPEATS
    assert t.seconds == pytest.approx(t.sizing_seconds + sum(t.timings.seconds))


@pytest.mark.parametrize("dtype", throughput.MATMUL_DTYPES)
def test_matmul_probe_in_every_dtype(dtype):
    t = throughput.matmul_throughput("cpu", dtype, budget=0.3)
    assert 128 <= t.size <= throughput.MATMUL_LIMIT["cpu"] and t.size % 64 == 0
    assert t.work == 2 * t.size**3 and t.rate > 0 and t.dtype == dtype
    assert throughput.MIN_REPEATS <= len(t.timings.seconds) <= throughput.MAX_REPEATS


def test_fit_size_stops_at_the_limit_or_the_target():
    calls = []

    def make_call(n):
        calls.append(n)
        return lambda: torch.zeros(n).sum()
    size, _, seconds = throughput.fit_size(make_call, 64, 4096, 1, "cpu", target=10.0, align=64)
    assert size == 4096 == calls[-1]              # a cheap call grows to the limit ...
    assert calls == sorted(calls) and len(calls) <= 6  # ... in a few steps (×4 at most each)
    size, _, _ = throughput.fit_size(make_call, 64, 4096, 1, "cpu", target=0.0, align=64)
    assert size == 64                             # a call already over the target stays put


def test_fmt_flops_keeps_slow_rates_readable():
    assert fmt_flops(1.0e9) == "1.0 GFLOP/s"
    assert fmt_flops(2.5e12) == "2.50 TFLOP/s"


def test_cpu_isa_names_pytorchs_kernels_and_the_flags():
    isa = cpu_isa()
    assert isa["pytorch_kernels"] == torch.backends.cpu.get_cpu_capability()
    assert all(isinstance(isa[f], bool) for f in ("avx2", "avx512", "avx512_bf16", "amx_tile"))
    assert describe("cpu")["cpu_isa"] == isa


def test_the_machine_described_in_a_child_process_is_the_one_described_here():
    """`python -m kit run` describes a CUDA machine in a child process, so that its own process
    never holds a CUDA context: the child's description, its numbers typed as here, is the
    in-process one (shown on this machine's CPU); on the CPU it stays in process."""
    here, child = describe("cpu"), describe_in_child("cpu", kernel_env())
    assert child == here
    assert {k: type(v) for k, v in child.items()} == {k: type(v) for k, v in here.items()}
    assert describe_apart("cpu") == here


def test_the_compilers_torch_compile_needs_are_found_as_inductor_and_triton_find_them():
    """Here (a g++ and a gcc on PATH) both are found and answer `--version`; with CXX and CC
    naming no compiler, Inductor's lookup and Triton's order find none, and each says what to
    install (a fresh process: Inductor reads CXX when its config is imported)."""
    from torch._inductor.cpp_builder import get_cpp_compiler
    cxx, cc = compilers("cuda")
    assert cxx.found and cxx.command == get_cpp_compiler() and cc.found
    assert [c.language for c in compilers("cpu")] == ["C++"]
    script = ("import json; from kit.studies.setup_check import compilers; "
              "print(json.dumps([[c.found, c.line()] for c in compilers('cuda')]))")
    env = {**kernel_env(), "CXX": "/nonexistent/c++", "CC": "/nonexistent/cc"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, check=True)
    (cxx_found, cxx_line), (cc_found, cc_line) = json.loads(done.stdout.splitlines()[-1])
    assert not cxx_found and "none found" in cxx_line and "apt-get install g++" in cxx_line
    assert not cc_found and "none found" in cc_line and "apt-get install gcc" in cc_line
    assert "C++ compiler" in fix_for("compilers for torch.compile are present")


def _probe(dtype, rate):
    return throughput.Throughput("matmul", "cpu", dtype, 64, rate, Timings([1.0]), 0.0)


def test_a_slow_dtype_is_called_emulated_with_its_factor():
    speeds = dtype_speeds({"float32": _probe("float32", 70e9), "bfloat16": _probe("bfloat16", 1e9),
                           "float16": _probe("float16", 140e9)})
    slow, fast = speeds["bfloat16"], speeds["float16"]
    assert slow.slowdown == pytest.approx(70) and slow.slow and not fast.slow
    # recorded as a speed, named the way it reads: float16 here is twice float32's speed
    assert fast.summary()["speed_vs_float32"] == pytest.approx(2)
    assert slow.summary()["speed_vs_float32"] == pytest.approx(1 / 70)
    isa = {"pytorch_kernels": "AVX2", "avx512_bf16": False, "onednn_max_isa": "AVX2"}
    finding = speed_finding(slow, isa)
    assert "70× slower than float32" in finding and "AVX2" in finding
    assert "avx512_bf16: no" in finding and "oneDNN capped at AVX2" in finding
    note = dtype_note(slow, isa)
    assert 'dtype="float32" is the way out' in note and "twice the bytes" in note
    assert "native here" in dtype_note(fast, isa) and "way out" not in dtype_note(fast, isa)
    assert DtypeSpeed("bfloat16", 1.0, SLOW_FACTOR).slow is False  # the boundary is not slow


def test_dtype_speed_comes_from_chapter_00_when_recorded():
    recorded = {"settings": {"device": "cpu"},
                "results": {"matmul": {"float32": {"rate": 8e10}, "bfloat16": {"rate": 1e9}}}}
    speed = dtype_speed_here("cpu", "bfloat16", recorded)
    assert speed.slowdown == pytest.approx(80)
    assert dtype_speed_here("cpu", "float32", recorded) is None
    measured = dtype_speed_here("cpu", "bfloat16", {"settings": {"device": "cuda"}})
    assert measured.flops_per_second > 0 and measured.float32_flops_per_second > 0


def test_a_measured_rate_beside_float32s():
    from kit.measure.dtype_speed import beside_float32
    assert beside_float32("cpu", "float32", 1e9) is None  # nothing to compare, nothing measured
    speed = beside_float32("cpu", "bfloat16", 1e6)  # a rate far below any float32 matmul's
    assert speed.flops_per_second == 1e6 and speed.float32_flops_per_second > 1e6 and speed.slow
