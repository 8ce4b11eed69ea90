"""The expert kernel (`kit.engine.layers.expert_kernel`): built here, equal to the products it
replaces on every shape its loops split (rows of a block, the vector tail, empty input)."""
import pytest
import torch

from kit.engine.layers import expert_kernel
from kit.engine.layers.expert_kernel import expert_products


def by_definition(rows, weights, experts):
    return torch.stack([weights[e].double() @ r.double() for r, e in zip(rows, experts)]) \
        if len(rows) else torch.zeros(0, weights.shape[1], dtype=torch.double)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("e,n,k,tokens,top", [
    (4, 7, 5, 3, 2),       # fewer output rows than a task's, K shorter than a vector
    (8, 64, 40, 5, 2),     # a vector tail in K
    (16, 33, 100, 8, 4),   # a last task of one row
    (128, 96, 2048, 8, 8),  # Qwen3-30B-A3B's expert count and rows, narrow
    (3, 17, 48, 1, 1),     # one token
    (1, 40, 75, 7, 1),     # one group of 7 rows (a dense layer's batch): tiles of 3, 3 and 1
    (2, 48, 64, 5, 2),     # groups of 5 rows: a tile of 3, then of 2
])
def test_the_kernel_equals_the_definition(dtype, e, n, k, tokens, top):
    torch.manual_seed(0)
    weights = torch.randn(e, n, k).to(dtype)
    experts = torch.randn(tokens, e).topk(top).indices.flatten().sort().values
    rows = torch.randn(len(experts), k).to(dtype)
    got = expert_products(rows, weights, experts)
    assert got.dtype == dtype and got.shape == (len(experts), n)
    want = by_definition(rows, weights, experts)
    assert (got.double() - want).abs().max() <= (1e-6 if dtype == torch.float32 else 1e-2) \
        * want.abs().max()


def test_a_groups_rows_multiplied_together_equal_each_row_multiplied_alone():
    """Several rows of a group run in tiles that load each weight vector once for all of them,
    summing every product in the order a single row's is summed."""
    torch.manual_seed(0)
    weights = torch.randn(3, 64, 2048)
    experts = torch.tensor([0, 1, 1, 1, 1, 1, 1, 1, 2, 2])
    rows = torch.randn(len(experts), 2048)
    together = expert_products(rows, weights, experts)
    alone = torch.cat([expert_products(r[None], weights, e[None]) for r, e in zip(rows, experts)])
    torch.testing.assert_close(together, alone, rtol=1e-6, atol=1e-6)


def test_a_dense_weight_is_multiplied_as_one_experts():
    """`weight_products`: x [..., K] times a weight [N, K]ᵀ plus its bias, as F.linear."""
    torch.manual_seed(0)
    x, weight, bias = torch.randn(2, 3, 96), torch.randn(40, 96), torch.randn(40)
    got = expert_kernel.weight_products(x, weight, bias)
    assert got.shape == (2, 3, 40)
    torch.testing.assert_close(got, torch.nn.functional.linear(x, weight, bias))
    torch.testing.assert_close(expert_kernel.weight_products(x, weight),
                               torch.nn.functional.linear(x, weight))


def test_no_rows_give_no_output_and_unpicked_experts_are_never_read():
    weights = torch.full((4, 16, 32), float("nan"))
    weights[2] = 1.0
    assert expert_products(torch.ones(0, 32), weights, torch.zeros(0, dtype=torch.int64)) \
        .shape == (0, 16)
    got = expert_products(torch.ones(2, 32), weights, torch.tensor([2, 2]))
    assert got.eq(32).all()


def test_it_is_built_for_this_machine_once_and_kept():
    """The library's name holds the source, the compiler and the CPU's features; a second
    call reuses the loaded library."""
    lib = expert_kernel.library()
    assert lib is not None and expert_kernel.library() is lib
    built = list((expert_kernel.CACHE / "kernels").glob("expert_products-*.so"))
    assert any(p.name == lib._name.split("/")[-1] for p in built)


def test_compiled_code_calls_it_as_one_opaque_op():
    weights = torch.randn(8, 24, 64)
    experts = torch.tensor([1, 1, 5])

    def step(rows):
        return expert_products(rows * 2, weights, experts) + 1

    rows = torch.randn(3, 64)
    got = torch.compile(step, fullgraph=True)(rows)
    torch.testing.assert_close(got, step(rows))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_expert_bench_runs_every_way_on_one_routing_and_checks_each(dtype):
    """`python -m kit bench experts`' measurement on tiny-moe: every way (vLLM's fused MoE
    where its CPU build is installed) gives the kernel's output, and the bytes to read are the
    picked experts' own."""
    from kit.config import load
    from kit.studies.expert_layer import outside_tolerance, time_expert_layer
    arch = load("cpu-small", model="tiny-moe").arch
    layer = time_expert_layer(arch, dtype, 4, rounds=2, calls=2)
    ways = {r["way"] for r in layer.rows()}
    assert {"kernel", "grouped", "gathered"} <= ways
    assert ways | set(layer.skipped) == {"kernel", "grouped", "gathered", "vllm"}
    assert outside_tolerance(layer) == []
    per_expert = 3 * arch.hidden_size * arch.moe_intermediate_size * (4 if dtype == "float32" else 2)
    assert layer.bytes_read == layer.experts_read * per_expert
    assert 1 <= layer.experts_read <= min(arch.num_experts, 4 * arch.num_experts_per_tok)


def test_a_compiled_prefill_multiplying_in_float32_runs_the_kernel(monkeypatch):
    """Where compiled code multiplies 16-bit weights in float32 (`Decoder.multiply_in`, a CPU
    without native bf16), a prefill's many pairs run the kernel too: that float32 product
    without a float32 copy of every expert. Eager code is unchanged (the grouped product)."""
    from kit.config import load
    from kit.engine.layers.experts import SparseMoE
    arch = load("cpu-small", model="tiny-moe").arch
    torch.manual_seed(0)
    moe = SparseMoE(arch).to(torch.bfloat16).requires_grad_(False)
    for p in moe.parameters():
        torch.nn.init.normal_(p, 0, 0.3)
    calls, real = [], expert_kernel.library
    monkeypatch.setattr(expert_kernel, "library", lambda: calls.append(1) or real())
    x = torch.randn(3 * arch.num_experts, arch.hidden_size, dtype=torch.bfloat16)
    moe.experts.matmul_dtype = torch.float32
    eager = moe(x).float()
    assert calls == []
    compiled = torch.compile(moe, fullgraph=True)(x).float()
    assert len(calls) == 2  # gate and up, then down
    assert (compiled - eager).abs().max() <= 3e-2 * eager.abs().max()


def test_without_a_working_compiler_it_says_so_once_and_the_experts_multiply_as_before(
        monkeypatch):
    from kit.config import load
    from kit.engine.layers.experts import SparseMoE
    monkeypatch.setenv("CC", "/nonexistent/cc")
    expert_kernel.library.cache_clear()
    try:
        with pytest.warns(UserWarning, match="the expert kernel did not build"):
            assert expert_kernel.library() is None
        moe = SparseMoE(load("cpu-small", model="tiny-moe").arch).requires_grad_(False)
        for p in moe.parameters():
            torch.nn.init.normal_(p, 0, 0.1)
        assert not moe.experts.kernel_built and not moe.experts.one_kernel(2)
        x = torch.randn(2, moe.gate.in_features)
        assert moe(x).isfinite().all()
    finally:
        expert_kernel.library.cache_clear()
