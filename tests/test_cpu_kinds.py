"""Every CPU kind takes its own path: the kit names the kind from PyTorch's cpuinfo, and leaves
every kernel choice to the library that runs the kernel. vLLM's choices are asked on this CPU
and, through PyTorch's probes that vLLM reads, as another kind would answer them; the one
native trial of an AMX kernel runs wherever it can and expects what the CPU kind implies."""
import platform

import pytest
import torch

from kit.measure.device import CPU_KINDS, cpu_isa, cpu_kind_of
from kit.vllm.installed import vllm_missing

X86 = platform.machine() in ("x86_64", "AMD64")
needs_vllm = pytest.mark.skipif(vllm_missing() is not None, reason=str(vllm_missing()))
X86_FLAGS = dict(arch="x86_64", avx2=True, avx512=True, avx512_bf16=True, amx_tile=True)


@pytest.mark.parametrize("flags, kind", [
    ({}, "amx"), ({"amx_tile": False}, "avx512_bf16"),
    ({"amx_tile": False, "avx512_bf16": False}, "avx512"),
    ({"amx_tile": False, "avx512_bf16": False, "avx512": False}, "avx2"),
    ({"amx_tile": False, "avx512_bf16": False, "avx512": False, "avx2": False}, "other")])
def test_each_x86_kind_is_named_by_its_best_feature(flags, kind):
    assert cpu_kind_of({**X86_FLAGS, **flags}) == kind


def test_arm_is_named_by_its_bf16_and_this_cpu_by_its_own_flags():
    assert cpu_kind_of({"arch": "aarch64", "arm_bf16": True}) == "arm_bf16"
    assert cpu_kind_of({"arch": "aarch64", "arm_bf16": False}) == "arm"
    kind = cpu_kind_of(cpu_isa())
    assert kind in CPU_KINDS
    assert (kind == "amx") == torch.cpu._is_amx_tile_supported()


@pytest.fixture
def amx(request, monkeypatch):
    """This CPU as vLLM sees it, with or without AMX tiles (PyTorch's probe, which vLLM asks)."""
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: request.param)
    return request.param


@pytest.mark.skipif(not X86, reason="vLLM's AMX kernels are x86's")
@pytest.mark.parametrize("amx", [True, False], indirect=True, ids=["amx", "no-amx"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.vllm
@needs_vllm
def test_vllm_takes_amx_kernels_only_for_bf16_where_the_cpu_has_amx(amx, dtype):
    from kit.vllm.cpu_kernels import attention_isa, moe_isa
    want = "amx" if amx and dtype == torch.bfloat16 else "vec"
    assert moe_isa(dtype, 256, 512) == (want, None)
    assert attention_isa(dtype, 128, 64) == want
    assert attention_isa(dtype, 16, 64) == "vec16"  # AMX takes whole blocks of 32


@pytest.mark.vllm
@needs_vllm
def test_vllm_loaded_the_kernel_library_built_for_this_cpu_kind():
    from kit.vllm.cpu_kernels import kernel_library
    want = {"amx": "_C", "avx512_bf16": "_C", "avx512": "_C_AVX512", "avx2": "_C_AVX2",
            "arm_bf16": "_C", "arm": "_C"}[cpu_kind_of(cpu_isa())]
    assert kernel_library() == want


@pytest.mark.skipif(not X86, reason="vLLM's AMX kernels are x86's")
@pytest.mark.vllm
@needs_vllm
def test_vllms_amx_moe_kernel_runs_only_where_there_is_amx_and_a_crash_is_a_reason():
    """The fused MoE's trial at "amx", in a child process: it runs on a CPU with AMX; on any
    other the child dies (SIGILL where the library has the AMX code, as on AVX-512 without AMX)
    or refuses, and this process goes on with the reason in words. Its "vec" kernel runs on
    every x86 CPU (the trial `bench experts` runs, remembered once it passed)."""
    from kit.vllm.fused_moe import TRIAL, trial_failure
    from kit.measure.in_child import try_in_child
    failure = try_in_child(TRIAL, "amx", "bfloat16")
    if torch.cpu._is_amx_tile_supported():
        assert failure is None
    else:
        assert failure is not None
        if cpu_kind_of(cpu_isa()) == "avx512_bf16":
            assert failure == "killed by SIGILL (an instruction this CPU does not have)"
    assert trial_failure("vec", "bfloat16") is None
