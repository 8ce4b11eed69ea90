"""Chapter 04's step breakdown as a function of a profile's rows: a GPU's kernels each counted
once whatever host rows surround them (eager, compiled, CUDA-graph replay), and the CPU's split
exactly the host-op split it always was. The GPU tables are a fixture of real kernel names with
illustrative times (tests/fixtures/step_profiles_cuda.json says where each name comes from);
nothing here runs on or measures a GPU."""
from pathlib import Path

import pytest
import torch

from kit.measure.profile_rows import ProfileRow, load_profile_tables, rows_from_profile, \
    save_profile_tables
from kit.measure.step_breakdown import GEMM, PARTS, SAMPLING, StepBreakdown, kernel_part, \
    split_rows

FIXTURE = Path(__file__).parent / "fixtures" / "step_profiles_cuda.json"
ABOUT, TABLES = load_profile_tables(FIXTURE)
EXPECTED = (ABOUT["expected"]["gemm_us"] / 1e6, ABOUT["expected"]["sampling_us"] / 1e6)
WEIGHTS, SAMPLE, ELSE = PARTS


def without_host_rows(rows, keep=()):
    return [r for r in rows if r.device_type != "CPU" or r.name in keep]


@pytest.mark.parametrize("strategy", ["eager", "compiled", "cuda_graphs"])
def test_every_strategy_splits_to_the_kernels_it_ran(strategy):
    """Eager, compiled and the compiled step's graph replay ran the same weight products and the
    same argmax: all three split to the sums the fixture was built from."""
    assert split_rows(TABLES[strategy], "cuda") == pytest.approx(EXPECTED)


@pytest.mark.parametrize("strategy", ["eager", "compiled"])
def test_a_kernel_and_its_launching_op_are_not_both_counted(strategy):
    """Summing every row whose name matches (the CPU's way) counts aten::mm and its cuBLAS
    kernels, a Triton kernel and its launcher's row of the same name, twice."""
    every_row = sum(r.self_device_us for r in TABLES[strategy] if GEMM.search(r.name)) / 1e6
    assert every_row > 1.5 * EXPECTED[0]
    assert split_rows(TABLES[strategy], "cuda")[0] == pytest.approx(EXPECTED[0])


@pytest.mark.parametrize("strategy", ["compiled", "cuda_graphs"])
def test_host_rows_do_not_change_the_split(strategy):
    rows = TABLES[strategy]
    assert split_rows(without_host_rows(rows), "cuda") == pytest.approx(split_rows(rows, "cuda"))


def test_the_eager_attentions_batched_products_are_told_apart_by_their_launching_op():
    """One of the eager attention's bmm kernels is the very cuBLAS kernel of a weight product:
    names cannot tell them apart, aten::bmm's row (its kernels' time) can. Without it they
    would count as weight matmuls."""
    rows, bmm = TABLES["eager"], ABOUT["expected"]["eager_batched_products_us"] / 1e6
    kept = without_host_rows(rows, keep=("aten::bmm",))
    assert split_rows(kept, "cuda") == pytest.approx(EXPECTED)
    assert split_rows(without_host_rows(rows), "cuda")[0] == pytest.approx(EXPECTED[0] + bmm)


def test_annotations_copied_onto_the_device_are_not_counted():
    rows = TABLES["compiled"]
    annotation = next(r for r in rows if r.annotation)
    assert annotation.device_type == "CUDA" and not annotation.on_device
    fake = ProfileRow("nvjet_tst_64x8_64x16_4x1_v_bz_TNT", "CUDA", 3, 0.0, 1e6, annotation=True)
    assert split_rows(rows + [fake], "cuda") == split_rows(rows, "cuda")


@pytest.mark.parametrize("name, part", [
    # cuBLAS(Lt) and CUTLASS products
    ("nvjet_tst_64x24_64x16_4x1_v_bz_splitK_TNT", WEIGHTS),
    ("nvjet_hsh_128x256_64x4_2x1_v_bz_coopA_bias_TNN", WEIGHTS),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1"
     "_execute_segment_k_off_kernel__5x_cublas", WEIGHTS),
    ("void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_32x32_128x2_tn_align8>"
     "(cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_32x32_128x2_tn_align8::Params)", WEIGHTS),
    ("ampere_bf16_s16816gemm_bf16_256x128_ldg8_f2f_stages_32x3_nn", WEIGHTS),
    ("void gemv2T_kernel_val<int, int, __half, __half, __half, float, 128, 16, 2, 4, false, "
     "false, cublasGemvParamsEx<int, cublasGemvTensorStridedBatched<__half const>, "
     "cublasGemvTensorStridedBatched<__half const>, cublasGemvTensorStridedBatched<__half>, "
     "float> >(...)", WEIGHTS),
    ("std::enable_if<!(false), void>::type internal::gemvx::kernel<int, int, float, float, "
     "float, float, false, true, true, false, 7, false, cublasGemvParamsEx<...> >(...)", WEIGHTS),
    ("void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float>"
     "(cublasLt::cublasSplitKParams<float>)", WEIGHTS),
    # Inductor's Triton kernels
    ("triton_tem_fused_mm_0", WEIGHTS), ("triton_tem_fused__to_copy_addmm_gelu_t_9", WEIGHTS),
    ("triton_red_fused_mm_0", WEIGHTS), ("triton_poi_fused_addmm_relu_0", ELSE),
    ("triton_tem_fused_bmm_19", ELSE), ("triton_poi_fused_mul_silu_2", ELSE),
    ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", ELSE),
    ("triton_red_fused__to_copy_add_mean_mul_pow_rocm_unquantized_gemm_rsqrt_0", ELSE),
    ("triton_red_fused_argmax_0", SAMPLE),
    # attention kernels carry cutlass:: types but are no products with the weights
    ("void pytorch_flash::flash_fwd_kernel<pytorch_flash::Flash_fwd_kernel_traits<128, 128, 64, "
     "4, false, false, cutlass::bfloat16_t, pytorch_flash::Flash_kernel_traits<128, 128, 64, 4, "
     "cutlass::bfloat16_t> >, false, true, false, false, true, true, false, false>"
     "(pytorch_flash::Flash_fwd_params)", ELSE),
    ("fmha_cutlassF_bf16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel<"
     "cutlass::bfloat16_t, cutlass::arch::Sm80, true, 64, 64, 64, true, true>::Params)", ELSE),
    ("void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnFwdSm90<...> > >"
     "(flash::FlashAttnFwdSm90<...>::Params)", ELSE),
    # sampling, copies, the rest
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::ArgMaxOps"
     "<float>, unsigned int, long, 4, 4> >(at::native::ReduceOp<float, at::native::ArgMaxOps"
     "<float>, unsigned int, long, 4, 4>)", SAMPLE),
    ("Memcpy HtoD (Pageable -> Device)", ELSE), ("Memset (Device)", ELSE),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctorOnSelf_add<"
     "c10::BFloat16>, std::array<char*, 2ul> >(int, at::native::CUDAFunctorOnSelf_add<"
     "c10::BFloat16>, std::array<char*, 2ul>)", ELSE)])
def test_device_kernels_are_sorted_into_parts_by_name(name, part):
    assert kernel_part(name) == part


def old_cpu_split(events) -> tuple[float, float]:
    """The CPU's split as it was written before the rows (the regexes over key_averages)."""
    gemm = sampling = 0.0
    for e in events:
        if GEMM.search(e.key):
            gemm += e.self_cpu_time_total / 1e6
        elif SAMPLING.search(e.key):
            sampling += e.self_cpu_time_total / 1e6
    return gemm, sampling


def test_the_cpu_split_is_the_host_op_split_it_was(tmp_path):
    """A real CPU profile: the rows split to exactly the old numbers, and a saved table reads
    back row for row and splits the same."""
    from kit.measure.profiler import profiled
    x, w, b = torch.randn(4, 64), torch.randn(64, 64), torch.randn(64)
    with torch.no_grad(), profiled("cpu") as prof:
        for _ in range(3):
            (torch.nn.functional.linear(x, w, b) @ w).float().argmax(-1)
            torch.bmm(x[None], w[None])
    rows = rows_from_profile(prof)
    assert {r.device_type for r in rows} == {"CPU"}
    gemm, sampling = split_rows(rows, "cpu")
    assert (gemm, sampling) == old_cpu_split(prof.key_averages())
    assert gemm > 0 and sampling > 0
    about, tables = load_profile_tables(save_profile_tables(tmp_path / "t.json", {"cpu": rows},
                                                            {"device": "cpu"}))
    assert about == {"device": "cpu"} and tables["cpu"] == rows


def test_a_gpu_breakdown_keeps_its_kernel_times_in_the_timed_step():
    """On a GPU the parts were timed on the device's clock, which the profiler does not slow:
    in the timed median they keep their seconds, the rest of the median is everything else,
    and the matmuls' rate is the measured one. On the CPU the shares scale (as before)."""
    gpu = StepBreakdown("eager", 3, 0.012, 0.003, 0.0001, 6_000_000, "cuda")
    parts = gpu.scaled(0.008)
    assert parts == pytest.approx({WEIGHTS: 0.003, SAMPLE: 0.0001, ELSE: 0.0049})
    assert gpu.gemm_bandwidth_at(0.008) == gpu.gemm_bandwidth == pytest.approx(2e9)
    cpu = StepBreakdown("eager", 3, 0.012, 0.003, 0.0001, 6_000_000, "cpu")
    assert cpu.scaled(0.008)[WEIGHTS] == pytest.approx(0.002)
    assert cpu.gemm_bandwidth_at(0.008) == pytest.approx(3e9)
