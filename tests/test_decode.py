"""Chapter 04: paged decode against the no-cache reference, the roofline arithmetic, bad input."""
import json
import os
import statistics
from pathlib import Path

import pytest
import torch

import kit
from kit.cli.main import main
from kit.config import DTYPE_BYTES, TOLERANCE, ModelConfig
from kit.engine.decode import (batch_for_run, generate, make_prompts, new_batch, peak_blocks,
                               prefill_function, step_function)
from kit.engine.kv_cache import KVCacheLayout, allocate
from kit.engine.kv_specs import attention_specs
from kit.engine.model import build_model
from kit.engine.no_cache import check_against_no_cache
from kit.errors import ConfigError
from kit.measure.roofline import decode_step_cost, weight_bytes_per_step
from kit.measure.step_breakdown import GEMM, SAMPLING, break_down_steps
from kit.engine.decode_fit import check_request, early_fit
from kit.studies.decode_timing import run_decode


def arch(heads, kv_heads, family="llama", **extra):
    return ModelConfig.from_dict({
        "model_type": family, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": 16,
        "vocab_size": 101, "max_position_embeddings": 256, **extra}, f"{family}-{heads}-{kv_heads}")


ARCHS = {"gqa": arch(4, 2), "mqa": arch(4, 1), "mqa-gemma-tied": arch(
    4, 1, "gemma", tie_word_embeddings=True, hidden_act="gelu"), "mha-qwen2-bias": arch(4, 4, "qwen2"),
    # windows of 5 and 6 (contexts reach 16): sliding, capped, sandwich-normed and QK-normed
    "window-mistral": arch(4, 2, "mistral", sliding_window=5),
    "window-gemma2-softcap": arch(4, 2, "gemma2", sliding_window=6, hidden_act="gelu",
                                  attn_logit_softcapping=5.0, final_logit_softcapping=3.0),
    "window-gemma3": arch(4, 1, "gemma3_text", sliding_window=5, hidden_act="gelu",
                          layer_types=["sliding_attention", "full_attention"],
                          rope_local_base_freq=10000.0, rope_theta=1e6)}
BLOCK_SIZE = 4
LENGTHS = [3, 4, 5, 9]  # ending before, on and after block edges
STEPS = 7               # every sequence crosses at least one more block edge while decoding


def paged_run(a, dtype, lengths=LENGTHS, steps=STEPS, spare_blocks=3, block_size=BLOCK_SIZE):
    model = build_model(a, dtype, "cpu", seed=0)
    layout = KVCacheLayout.for_model(a, block_size, dtype)
    batch = batch_for_run(layout, lengths, steps, "cpu", spare_blocks)
    prompts = make_prompts(lengths, a.vocab_size, seed=1)
    run = generate(model, batch, prompts, steps)
    return model, prompts, batch, run


@pytest.mark.parametrize("key", ARCHS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_paged_decode_equals_the_no_cache_reference(key, dtype):
    model, prompts, batch, run = paged_run(ARCHS[key], dtype)
    result = check_against_no_cache(model, prompts, run, dtype)
    assert len(result.errors) == STEPS + 1
    assert result.ok, result.errors
    assert result.agreement_up_to_ties > 0.9
    if dtype == "float32":
        assert result.max_error < 1e-5


def test_the_blocks_really_are_paged():
    """Sequences decode in turn, so the blocks they open interleave: reading a sequence's
    context needs its table, not a contiguous range."""
    _, _, batch, _ = paged_run(ARCHS["gqa"], "float32")
    tables = {i: t[0] for i, t in batch.allocator.tables.items()}  # one group: one table each
    assert any(t != list(range(t[0], t[0] + len(t))) for t in tables.values())
    for i, n in enumerate(LENGTHS):
        assert batch.allocator.num_computed_tokens[i] == n + STEPS
        assert batch.block_tables[0, i, :len(tables[i])].tolist() == tables[i]


@pytest.mark.parametrize("key", ["window-mistral", "window-gemma3"])
def test_sliding_groups_hand_back_blocks_that_leave_their_window(key):
    """As vLLM's sliding-window manager does, before each step a sliding group hands back the
    blocks wholly before its window (the null block takes their place in its table): the run
    holds fewer blocks than full attention would, runs on exactly `peak_blocks` blocks, and
    its logits still equal the no-cache reference."""
    a = ARCHS[key]
    spec = KVCacheLayout.for_model(a, BLOCK_SIZE, "float32")
    need = peak_blocks(spec, LENGTHS, STEPS)
    at_end = sum(-(-(n + STEPS) // BLOCK_SIZE) for n in LENGTHS)
    full = 1 + at_end * len(spec.groups)  # none handed back
    model, prompts, batch, run = paged_run(a, "float32", spare_blocks=0)
    assert batch.kv_cache.shape[:3] == (spec.group_size, 2, need)  # vLLM's layout, no spare
    assert check_against_no_cache(model, prompts, run, "float32").max_error < 1e-5
    assert 1 + max(batch.held) == need < full and len(batch.held) == len(set(LENGTHS)) + STEPS
    sliding = [g for g, group in enumerate(spec.groups) if group.window is not None]
    for g, group in enumerate(spec.groups):
        for i, n in enumerate(LENGTHS):  # context n + STEPS: its first tokens skipped
            table = batch.block_tables[g, i].tolist()
            gone = (n + STEPS - 1 - group.window + 1) // BLOCK_SIZE if g in sliding else 0
            assert table[:max(gone, 0)] == [0] * max(gone, 0)
            assert 0 not in table[max(gone, 0):-(-(n + STEPS) // BLOCK_SIZE)]
    if len(spec.groups) > 1:  # a full group keeps every block, so the run holds more
        assert max(batch.held) > sum(-(-(n + STEPS) // BLOCK_SIZE) for n in LENGTHS)


def tables_of(batch) -> list[list[list[int]]]:
    """The block manager's tables as the step reads them: [groups][seqs][width], padded with
    the null block."""
    width = batch.block_tables.shape[2]
    return [[batch.allocator.tables[i][g] + [0] * (width - len(batch.allocator.tables[i][g]))
             for i in range(len(batch.lengths))] for g in range(len(batch.groups))]


@pytest.mark.parametrize("key", ["gqa", "window-mistral", "window-gemma3"])
@pytest.mark.parametrize("lengths", [LENGTHS, [9, 9, 9, 9]])
@pytest.mark.parametrize("mirror", [False, True])
def test_the_step_reads_the_block_managers_tables_after_every_step(key, lengths, mirror):
    """After the prefill and after every step's bookkeeping (a sliding group handing blocks
    back, new blocks opened), the tables the step reads equal the block manager's, for mixed
    and equal prompt lengths (equal ones cross block edges on the same steps); with `mirror`
    the host's tables are a tensor of their own, sent once per step that changed them, as on a
    GPU (there through pinned memory); the logits stay the no-cache reference's."""
    a = ARCHS[key]
    model = build_model(a, "float32", "cpu", seed=0)
    batch = batch_for_run(KVCacheLayout.for_model(a, BLOCK_SIZE, "float32"), lengths, STEPS,
                          "cpu")
    if mirror:
        batch.host_tables = batch.block_tables.clone()
    prompts = make_prompts(lengths, a.vocab_size, seed=1)
    batch.start(model, prompts)
    assert batch.block_tables.tolist() == tables_of(batch) and not batch.tables_changed
    step, freed = step_function(model, batch.max_context_len), 0
    for _ in range(STEPS):
        before = tables_of(batch)
        batch.step(step)
        assert batch.block_tables.tolist() == tables_of(batch)
        freed += sum(b != 0 and n == 0 for g, gn in zip(before, tables_of(batch))
                     for row, rn in zip(g, gn) for b, n in zip(row, rn))
    assert (freed > 0) == ("window" in key)
    run = generate(model, batch, prompts, STEPS)
    assert check_against_no_cache(model, prompts, run, "float32").max_error < 1e-5


def test_a_batch_refuses_a_cache_or_a_model_that_is_not_its_layouts():
    a = ARCHS["window-gemma3"]
    layout = KVCacheLayout.for_model(a, BLOCK_SIZE, "float32")  # two groups of one layer
    one_group = KVCacheLayout.for_model(ARCHS["mqa"], BLOCK_SIZE, "float32")
    with pytest.raises(ValueError, match="not the layout's"):
        new_batch(layout, allocate(one_group, 40, "cpu"), LENGTHS, STEPS)
    batch = new_batch(layout, allocate(layout, 40, "cpu"), LENGTHS, STEPS)
    three = arch(4, 1, "gemma3_text", sliding_window=5, hidden_act="gelu", num_hidden_layers=3)
    with pytest.raises(ValueError, match="a layout of 2 layers for a model of 3"):
        batch.start(build_model(three, "float32", "cpu"), make_prompts(LENGTHS, a.vocab_size))
    with pytest.raises(RuntimeError, match="bind_kv_cache"):  # a paged forward needs the binding
        prefill_function(build_model(a, "float32", "cpu"))(
            torch.zeros(1, 3, dtype=torch.long), torch.zeros(2, 3, dtype=torch.long),
            batch.kv_cache)


def test_a_wrong_context_length_is_caught():
    """The comparison fails for a step that puts each token one position early (so the check
    can fail)."""
    a = ARCHS["gqa"]
    model, prompts, batch, run = paged_run(a, "float32")
    good = step_function(model)

    def short(input_ids, positions, block_tables, kv_cache):
        return good(input_ids, positions - 1, block_tables, kv_cache)
    broken = generate(model, batch, prompts, STEPS, step=short)
    assert not check_against_no_cache(model, prompts, broken, "float32").ok


def test_stale_blocks_do_not_leak_into_a_new_run():
    """A second run on the same cache and tensors (as every strategy's timed run is) gives
    the same logits as the first, whatever the first left in the blocks."""
    model, prompts, batch, first = paged_run(ARCHS["mqa"], "float32")
    again = generate(model, batch, prompts, STEPS)
    torch.testing.assert_close(again.logits, first.logits)


def test_tolerances_order_by_precision():
    assert TOLERANCE["float32"] < TOLERANCE["float16"] < TOLERANCE["bfloat16"] <= 0.05


def test_roofline_bytes_and_flops_by_hand():
    a = ModelConfig.from_dict({
        "model_type": "llama", "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4, "vocab_size": 10}, "hand")
    # embed 10×8 = 80; per layer q 64 + k 32 + v 32 + o 64 + MLP 3×8×16 = 384 + norms 16 = 592;
    # final norm 8; LM head 80.
    assert a.num_parameters() == 80 + 2 * 592 + 8 + 80 == 1352
    kv_per_token = 2 * 2 * 1 * 4 * 2  # K and V × layers × KV heads × head_dim × 2 bytes = 32
    full = attention_specs((None, None), 16, 1, 4, 2)
    assert sum(spec.bytes_per_token for spec in full) == kv_per_token
    cost = decode_step_cost(a, 2, full, [3, 5])
    assert cost.weight_bytes == (1352 - 80 + 2 * 8) * 2 == 2576  # embedding: only 2 rows
    assert cost.kv_read_bytes == (2 + 4) * 32                     # the tokens before the new ones
    assert cost.kv_write_bytes == 2 * 32
    assert cost.logits_bytes == 2 * 10 * 2
    assert cost.total_bytes == 2576 + 192 + 64 + 40 == 2872
    # 2 FLOPs × 2 tokens × (2 × (64 + 32 + 32 + 64 + 384) + LM head 80) + attention
    # 4 × 2 layers × 2 heads × 4 head_dim × (3 + 5) attended tokens
    assert cost.flops == 2 * 2 * (2 * 576 + 80) + 4 * 2 * 2 * 4 * 8 == 5440
    assert cost.floor_seconds(2872e3) == pytest.approx(1e-3)
    # layer 0 slides over the last 4 tokens: it attends to 3 and 4, layer 1 to 3 and 5
    windowed = decode_step_cost(a, 2, attention_specs((4, None), 16, 1, 4, 2), [3, 5])
    assert windowed.kv_read_bytes == (2 + 3 + 2 + 4) * 16 and windowed.kv_write_bytes == 64
    assert windowed.flops == 2 * 2 * (2 * 576 + 80) + 4 * 2 * 4 * (3 + 4 + 3 + 5)


def test_tied_embeddings_are_read_once():
    a = ModelConfig.from_dict({
        "model_type": "llama", "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4, "vocab_size": 10,
        "tie_word_embeddings": True}, "hand-tied")
    assert weight_bytes_per_step(a, 2, 2) == (80 + 2 * 592 + 8 + 2 * 8) * 2


def test_roofline_weights_match_the_model_for_a_real_shape():
    s = kit.load("cpu-small")
    model = build_model(s.arch, s.dtype, "cpu")
    untied_embedding = model.embed_tokens.weight.numel() * 2
    assert weight_bytes_per_step(s.arch, 2, 0) == \
        sum(p.numel() * 2 for p in model.parameters()) - untied_embedding


def test_too_many_tokens_for_the_cache_says_how_many_blocks_are_missing():
    # tiny: 2 × 4 layers × 4 KV heads × 32 × 2 bytes = 2048 B per token, 32 KiB per block of 16.
    # 4 sequences of 64 + 15 tokens need 5 blocks each, and the null block: 21 blocks; the
    # budget holds 10.
    s = kit.load("cpu-small", kv_cache_memory_bytes=10 * 32768)
    layout = KVCacheLayout.for_settings(s)
    with pytest.raises(ConfigError, match="needs 21 KV cache blocks.*null block.*holds 10: 11 "
                                          "blocks missing"):
        early_fit(s, layout)
    with pytest.raises(ConfigError, match="11 blocks missing"):
        run_decode(s, layout, progress=lambda m: None)


def test_the_largest_possible_cache_is_checked_before_loading_anything():
    s = kit.load("cpu-small", device_memory="45MB")  # 0.9 × 45 MB < 40.6 MB of weights
    with pytest.raises(ConfigError, match="holds 0: 21 blocks missing"):
        early_fit(s, KVCacheLayout.for_settings(s))


@pytest.mark.parametrize("overrides, message", [
    ({"batch_size": 9}, "batch_size=9 is above max_num_seqs=8"),
    ({"input_len": 1000, "output_len": 100}, "exceeds max_model_len=1024"),
    ({"strategies": ["eager", "fast"]}, r"unknown strategies \['fast'\].*'guard_free'"),
    ({"strategies": "cuda_graphs"}, "cannot run on device='cpu'"),
])
def test_bad_settings_are_refused_with_what_to_change(overrides, message):
    with pytest.raises(ConfigError, match=message):
        kit.load("cpu-small", **overrides)


def test_decode_needs_a_step_and_one_device():
    for overrides, message in (({"output_len": 1}, "output_len of 2 or more"),
                               ({"kv_cache_dtype": "fp8"}, "kv_cache_dtype='fp8'")):
        s = kit.load("cpu-small", **overrides)
        with pytest.raises(ConfigError, match=message):
            check_request(s, KVCacheLayout.for_settings(s))


def test_strategies_setting_accepts_lists_and_strings():
    assert kit.load("cpu-small", strategies="eager, guard_free").strategies == \
        ("eager", "guard_free")
    assert kit.load("cpu-small").strategies is None


@pytest.mark.slow
def test_bench_decode_writes_json_and_a_table(tmp_path, capsys):
    out = tmp_path / "decode.json"
    code = main(["bench", "decode", "-p", "strategies=eager", "-p", "output_len=4",
                 "-p", "kv_cache_memory_bytes=64MiB", "--out", str(out)])
    assert code == 0
    report = json.loads(out.read_text())
    eager = report["strategies"]["eager"]
    assert len(eager["step_seconds"]) == 3 == len(eager["floor_seconds"])
    assert eager["correctness"]["ok"] and report["mixed_lengths"]["ok"]
    assert report["limits"]["bandwidth"] > 0 and report["median_step_cost"]["total_bytes"] > 0
    limits = report["limits"]  # one copy before the timed runs, one after each of num_iters rounds
    assert len(limits["bandwidth_samples"]) == kit.load("cpu-small").num_iters + 1
    assert limits["bandwidth"] == statistics.median(limits["bandwidth_samples"])
    from kit.show.judgement import FLOOR_SHARE
    assert FLOOR_SHARE in capsys.readouterr().out  # the table's step against its floor
    parts = eager["breakdown"]
    assert parts["steps"] == 3 and parts["gemm_seconds"] > 0
    assert parts["gemm_weight_bytes"] == kit.load("cpu-small").arch.linear_weights() * 2
    assert sum(parts["shares"].values()) == pytest.approx(1.0)


def test_bench_refuses_an_unknown_strategy(capsys):
    assert main(["bench", "decode", "-p", "strategies=warp_speed"]) == 2
    assert "known:" in capsys.readouterr().err


@pytest.mark.parametrize("preset", ["cpu-small", "cpu-real", "gpu"])
def test_every_preset_lists_the_decode_settings(preset):
    from kit.config import PARAMETERS, read_preset
    values = read_preset(preset)
    assert set(PARAMETERS) <= set(values)
    assert values["strategies"] is None and values["num_iters"] >= 1


@pytest.mark.parametrize("key", ["mqa", "window-gemma2-softcap"])
def test_the_compiled_step_equals_the_reference_too(key):
    """The compiled attention (products summed, fused with the gather) on a multi-query model
    and on one with windows and capped scores, across block edges and past the window,
    through a guard-free runner as chapter 04 times it."""
    from kit.engine.decode_runners import CPU_FREEZING
    from kit.engine.runners import make_runner
    a = ARCHS[key]
    model, prompts, batch, _ = paged_run(a, "float32")
    with torch.no_grad():
        batch.start(model, prompts)
        batch.make_room()
        runner = make_runner(step_function(model), "guard_free", "cpu", batch.step_args(),
                             dynamic_dims={}, inductor_config=CPU_FREEZING)
    run = generate(model, batch, prompts, STEPS, step=runner)
    result = check_against_no_cache(model, prompts, run, "float32")
    runner.discard()
    assert result.max_error < 1e-5, result.errors
    assert runner.graphs_compiled == 1


def test_attention_span_rounds_the_longest_context_to_whole_chunks():
    from kit.engine.layers.attention import VALUE_CHUNK, attention_span
    assert VALUE_CHUNK == 16
    assert attention_span(159, 256) == 160   # 128-token blocks: 160 positions read, not 256
    assert attention_span(160, 160) == 160
    assert attention_span(20, 24) == 24      # never past the table's positions


def test_a_batch_reads_its_span_not_its_whole_table():
    """With 32-token blocks, 47 tokens at most: the table holds 64 positions, the step reads 48
    (three chunks of 16); eager (matmuls), eager summed and compiled (summed by chunks, then
    chunks summed) steps equal the no-cache reference, and equal the whole table's attention."""
    from kit.engine.decode_runners import CPU_FREEZING
    from kit.engine.layers.attention import paged_decode_attention, summed_attention
    from kit.engine.runners import make_runner
    a, lengths, steps = ARCHS["gqa"], [20, 33, 40], 7
    model, prompts, batch, eager = paged_run(a, "float32", lengths, steps, block_size=32)
    cache = batch.kv_cache
    assert (batch.block_tables.shape[2] * 32, batch.max_context_len) == (64, 48)
    runs = {"eager": eager}
    with summed_attention():
        runs["eager summed"] = generate(model, batch, prompts, steps)
        q = torch.randn(len(lengths), a.num_attention_heads, a.head_dim)
        span, whole = (paged_decode_attention(q, cache[0], batch.block_tables[0],
                                              torch.tensor(lengths) + steps, n) for n in (48, None))
        torch.testing.assert_close(span, whole)
    with torch.no_grad():
        batch.start(model, prompts)
        batch.make_room()
        runner = make_runner(step_function(model, batch.max_context_len), "guard_free", "cpu",
                             batch.step_args(), dynamic_dims={}, inductor_config=CPU_FREEZING)
    runs["compiled"] = generate(model, batch, prompts, steps, step=runner)
    runner.discard()
    for name, run in runs.items():
        result = check_against_no_cache(model, prompts, run, "float32")
        assert result.max_error < 1e-5, (name, result.errors)


@pytest.mark.parametrize("name, part", [
    ("mkldnn::_linear_pointwise", "gemm"), ("aten::addmm", "gemm"), ("aten::mm", "gemm"),
    ("aten::linear", "gemm"), ("sm90_xmma_gemm_bf16bf16_bf16f32", "gemm"), ("nvjet_tst_64x8", "gemm"),
    ("aten::argmax", "sampling"), ("aten::bmm", "other"), ("aten::mul", "other"),
    ("graph_0_cpp_fused__softmax_mul_sum_3", "other"), ("aten::index_put_", "other")])
def test_profile_events_are_sorted_into_parts(name, part):
    """The weights' products (the CPU's and the GPU's kernel names) apart from the eager
    attention's batched products, sampling apart from both."""
    found = "gemm" if GEMM.search(name) else "sampling" if SAMPLING.search(name) else "other"
    assert found == part


def test_a_profiled_step_splits_into_parts_that_add_up():
    a = ARCHS["gqa"]
    model, prompts, batch, _ = paged_run(a, "float32")
    batch.start(model, prompts)
    step = step_function(model)
    parts = break_down_steps(lambda: batch.step(step), 3, "cpu", "eager", a.linear_weights() * 4)
    assert parts.steps == 3 and parts.gemm_seconds > 0 and parts.sampling_seconds > 0
    assert parts.gemm_seconds + parts.sampling_seconds <= parts.profiled_seconds
    assert sum(parts.scaled(0.01).values()) == pytest.approx(0.01)
    assert parts.gemm_bandwidth == pytest.approx(parts.gemm_weight_bytes / parts.gemm_seconds)
    # at the profiled step's own length the scaled rate is the raw one; a faster (unprofiled)
    # step of the same shares gives a proportionally higher rate
    assert parts.gemm_bandwidth_at(parts.profiled_seconds) == pytest.approx(parts.gemm_bandwidth)
    assert parts.gemm_bandwidth_at(parts.profiled_seconds / 2) == pytest.approx(
        2 * parts.gemm_bandwidth)
    assert list(batch.allocator.num_computed_tokens.values()) == [n + 3 for n in LENGTHS]  # real steps


@pytest.fixture(scope="module")
def gqa_runs():
    """gqa's paged run per dtype (model, prompts, batch), each built once, and one
    `CompiledGraphs` for the tests that compile its decode step on it: a frozen step, which
    Inductor's cache cannot hold, is compiled by the first of them and taken by the others
    whose Dynamo traces the same graph of the same shapes and weights (a trace of other
    shapes compiles its own). conftest's XDIST_GROUPS keeps these tests in one worker."""
    from kit.engine.runners import CompiledGraphs
    runs, shared = {}, CompiledGraphs()

    def run_of(dtype):
        if dtype not in runs:
            runs[dtype] = paged_run(ARCHS["gqa"], dtype)[:3]
        return runs[dtype]
    yield run_of, shared
    shared.clear()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_compiled_cpu_step_runs_onednn_prepacked_linears(gqa_runs, dtype):
    """Chapter 04's compiled step on the CPU multiplies by weights Inductor prepacked for oneDNN
    (mkldnn::_linear_pointwise) in both dtypes, never by MKL's packed GEMM (mkl::_mkl_linear),
    which Inductor picks for float32 when the batch is fixed; and its logits still equal the
    no-cache reference. A bf16 step multiplies in float32 where oneDNN has no bf16 kernels (as
    on this CPU, or under the emulation below)."""
    from torch.profiler import profile

    from kit.engine.decode_runners import decode_runner
    from kit.measure.device import onednn_has_kernels
    run_of, shared = gqa_runs
    model, prompts, batch = run_of(dtype)
    runner = decode_runner(model, batch, prompts, "guard_free", shared=shared)
    emulated = dtype == "bfloat16" and not onednn_has_kernels(torch.bfloat16)
    assert model.matmul_dtype == (torch.float32 if emulated else None)
    with profile() as prof:
        batch.step(runner)
    names = {e.key for e in prof.key_averages()}
    assert "mkldnn::_linear_pointwise" in names and "mkl::_mkl_linear" not in names, names
    run = generate(model, batch, prompts, STEPS, step=runner)
    runner.discard()
    result = check_against_no_cache(model, prompts, run, dtype)
    assert result.ok, result.errors


def test_a_frozen_step_comes_from_inductors_cache_with_the_models_own_weights():
    """The compiled CPU step's graph, its weights frozen and packed for oneDNN, goes to
    Inductor's FX graph cache instead of bypassing it; a model of the same shapes with other
    weights compiling its step again loads that graph (a cache hit, nothing generated) and
    multiplies by its own weights: its logits equal its own no-cache reference, not the
    first model's (kit/engine/frozen_graph_cache.py)."""
    from torch._dynamo.utils import counters
    from torch._inductor import config as inductor_config

    from kit.engine.decode_runners import decode_runner
    if not inductor_config.fx_graph_cache:
        pytest.skip("Inductor's FX graph cache is off (TORCHINDUCTOR_FX_GRAPH_CACHE=0)")
    a, runs = ARCHS["gqa"], []
    for seed in (0, 1):
        model = build_model(a, "float32", "cpu", seed=seed)
        batch = batch_for_run(KVCacheLayout.for_model(a, BLOCK_SIZE, "float32"), LENGTHS, STEPS,
                              "cpu", 3)
        prompts = make_prompts(LENGTHS, a.vocab_size, seed=1)
        before = dict(counters["inductor"])
        runner = decode_runner(model, batch, prompts, "guard_free")
        seen = {k: counters["inductor"][k] - before.get(k, 0) for k in counters["inductor"]}
        run = generate(model, batch, prompts, STEPS, step=runner)
        runner.discard()
        assert seen.get("mkldnn_linear_weight_pack_matcher_count", 0) > 0, seen  # packed
        assert seen.get("fxgraph_cache_bypass", 0) == 0, seen
        result = check_against_no_cache(model, prompts, run, "float32")
        assert result.ok and result.errors[0] < 1e-4, result.errors
        runs.append(run)
    assert seen.get("fxgraph_cache_hit", 0) == 1, seen  # the second model's compile
    assert not torch.allclose(runs[0].logits, runs[1].logits)


def test_a_runner_compiles_its_own_shapes_after_another_batchs_runner(gqa_runs):
    """Dynamo remembers the sizes a function saw by its file, line and name, which every
    runner's copy of the step shares: a runner built after one for a batch of other shapes
    must still compile its own shapes (made dynamic behind its back, a bf16 step's logits were
    off the reference by 60-80%)."""
    from kit.engine.decode_runners import decode_runner
    run_of, shared = gqa_runs
    model, prompts, batch, _ = paged_run(ARCHS["gqa"], "float32", [20, 33, 40], block_size=32)
    decode_runner(model, batch, prompts, "guard_free").discard()
    model, prompts, batch = run_of("bfloat16")
    runner = decode_runner(model, batch, prompts, "guard_free", shared=shared)
    run = generate(model, batch, prompts, STEPS, step=runner)
    runner.discard()
    result = check_against_no_cache(model, prompts, run, "bfloat16")
    assert result.ok, result.errors


def test_the_compiled_prefill_serves_every_prompt_length_with_one_graph(gqa_runs):
    """The CPU's compiled prefill (guard-free, weights frozen, the prompts' number and length
    dynamic), built on the batch's first group of prompts, serves the groups of the other
    lengths without compiling again (a recompile would be an error), and a run through it
    equals the no-cache reference at the prefill and at every step."""
    from kit.engine.decode_runners import decode_runner, prefill_runner
    run_of, shared = gqa_runs
    model, prompts, batch = run_of("float32")
    prefill = prefill_runner(model, batch, prompts)
    runner = decode_runner(model, batch, prompts, "guard_free", prefill, shared=shared)
    run = generate(model, batch, prompts, STEPS, step=runner, prefill=prefill)
    assert len(set(LENGTHS)) == 4 and prefill.graphs_compiled == 1
    result = check_against_no_cache(model, prompts, run, "float32")
    assert result.ok and result.errors[0] < 1e-4, result.errors


@pytest.mark.parametrize("key", ["window-gemma2-softcap", "window-gemma3"])
def test_a_prefill_past_the_score_bound_chunks_its_queries_to_the_same_run(key, monkeypatch):
    """With the bound on a prefill's score bytes forced low, the eager prefill takes its
    queries in chunks (the longest prompt's, not the shortest's) and the run's tokens and
    logits are the unchunked run's; the CPU's compiled prefill (checked on one of the two)
    keeps the whole score tensor and still serves every prompt length with one graph."""
    from kit.engine.decode_runners import prefill_runner
    from kit.engine.layers import prefill_attention as scores
    a = ARCHS[key]
    *_, whole = paged_run(a, "float32")
    monkeypatch.setattr(scores, "MAX_SCORE_BYTES", 200)
    heads = a.num_attention_heads
    assert scores.query_chunk(1, heads, 9, 6, 200) < 9 and scores.query_chunk(1, heads, 3, 6, 200) == 3
    model, prompts, batch, chunked = paged_run(a, "float32")
    assert torch.equal(chunked.tokens, whole.tokens)
    torch.testing.assert_close(chunked.logits, whole.logits, rtol=1e-5, atol=1e-5)
    if key != "window-gemma3":
        return  # the compiled prefill's path is the same for both: one compile is enough
    prefill = prefill_runner(model, batch, prompts)
    compiled = generate(model, batch, prompts, STEPS, prefill=prefill)
    assert prefill.graphs_compiled == 1
    torch.testing.assert_close(compiled.logits, whole.logits, rtol=1e-4, atol=1e-4)
    prefill.discard()


def test_the_eager_summed_runs_routing_is_recorded_by_a_rerun_that_sums(monkeypatch):
    """The eager step with the attention summed (`time_eager_summed`) is checked with an MoE's
    routing recorded by a rerun that sums as it did: a rerun that did not would round
    otherwise and could cross a near-tie the run did not (a gpt-oss-20b-like bf16 run's step
    was then 0.20 off its reference, against bf16's 4e-2)."""
    from kit.engine import routing_replay
    from kit.engine.layers.attention import summed_form
    from kit.studies import decode_timing
    reruns, real = [], routing_replay.generate
    monkeypatch.setattr(routing_replay, "generate",
                        lambda *a, **k: reruns.append(summed_form()) or real(*a, **k))
    moe = kit.load("cpu-small", model="tiny-moe").arch
    model, prompts, batch, _ = paged_run(moe, "float32", block_size=16)
    timing = decode_timing.StrategyTiming(decode_timing.EAGER_SUMMED, len(prompts))
    for _ in range(2):
        decode_timing.time_eager_summed(model, batch, prompts, STEPS, timing, "float32")
    assert reruns == [True] and len(timing.runs) == 2
    assert timing.correctness.ok and timing.correctness.routing.positions > 0


def test_an_moe_multiplying_bf16_weights_in_float32_compiles_rounding_as_eager_code():
    """Where 16-bit weights are multiplied in float32 (`Decoder.multiply_in`), a model with
    experts compiles with eager's casts emulated (`cpu_inductor_config`): its compiled MoE
    layer then equals the eager one in nearly every element. Without them Inductor keeps
    float32 between fused ops where eager code rounds (fewer than half of the elements equal),
    and a router's picks follow that difference. A dense model's settings only freeze."""
    from kit.engine.decode_runners import CPU_FREEZING, cpu_inductor_config
    from kit.engine.layers.experts import one_moe_layer
    arch = kit.load("cpu-small", model="tiny-moe").arch
    moe_model = build_model(arch, "bfloat16", "cpu")
    assert cpu_inductor_config(build_model(ARCHS["gqa"], "bfloat16", "cpu"),
                               torch.float32) == CPU_FREEZING
    assert cpu_inductor_config(moe_model, None) == CPU_FREEZING
    casts = cpu_inductor_config(moe_model, torch.float32)
    moe = one_moe_layer(arch, "bfloat16").requires_grad_(False)
    moe.gate.matmul_dtype = moe.experts.matmul_dtype = torch.float32
    x = torch.randn(5, arch.hidden_size, dtype=torch.bfloat16)
    eager = moe(x).float()
    diff = {}
    for name, config in (("plain", CPU_FREEZING), ("casts", casts)):
        torch._dynamo.reset()
        with torch._inductor.config.patch(config):
            diff[name] = (torch.compile(moe, fullgraph=True)(x).float() - eager).abs()
    print({n: f"{(d == 0).float().mean():.3f} equal, mean {d.mean():.1e}" for n, d in diff.items()})
    assert (diff["casts"] == 0).float().mean() >= 0.95
    assert diff["casts"].mean() * 10 < diff["plain"].mean()


EMULATED_AVX2 = """
import json, torch
from tests.test_decode import ARCHS, STEPS, paged_run
from torch.profiler import profile
from kit.engine.decode import generate
from kit.engine.no_cache import check_against_no_cache
from kit.engine.decode_runners import compiled_matmul_dtype, decode_runner
model, prompts, batch, _ = paged_run(ARCHS["gqa"], "bfloat16")
runner = decode_runner(model, batch, prompts, "guard_free")
with profile() as prof:
    batch.step(runner)
run = generate(model, batch, prompts, STEPS, step=runner)
print(json.dumps({"matmul_dtype": str(compiled_matmul_dtype(model, "cpu")),
                  "events": sorted({e.key for e in prof.key_averages()}),
                  "ok": check_against_no_cache(model, prompts, run, "bfloat16").ok}))
"""


def test_without_onednn_bf16_kernels_compiled_code_multiplies_in_float32():
    """Where oneDNN has no bf16 kernels (an AVX2-only x86, emulated here with
    ONEDNN_MAX_CPU_ISA=AVX2), a bf16 product is emulated several times slower than a float32
    one, and Inductor cannot prepack bf16 weights: the decode runner multiplies in float32
    (weights converted once, frozen, prepacked for oneDNN: mkldnn::_linear_pointwise runs) and
    its logits equal the no-cache reference within bf16's tolerance. The model's own dtype
    everywhere else. On a CPU that is such a machine (AVX2: no bf16 kernels), the bf16 case of
    `test_the_compiled_cpu_step_runs_onednn_prepacked_linears` runs exactly this, unemulated,
    so the emulated run (a compile of about 30 s) is left to CPUs with the kernels."""
    import subprocess
    import sys
    from kit.engine.decode_runners import compiled_matmul_dtype
    from kit.measure.device import onednn_has_kernels
    assert compiled_matmul_dtype(build_model(ARCHS["gqa"], "float32", "cpu"), "cpu") is None
    bf16 = build_model(ARCHS["gqa"], "bfloat16", "cpu")
    assert compiled_matmul_dtype(bf16, "cpu") == (None if onednn_has_kernels(torch.bfloat16)
                                                  else torch.float32)
    if not onednn_has_kernels(torch.bfloat16):
        return
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2",
           "PYTHONPATH": str(Path(__file__).parent.parent)}
    out = subprocess.run([sys.executable, "-c", EMULATED_AVX2], env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["matmul_dtype"] == "torch.float32"
    assert "mkldnn::_linear_pointwise" in result["events"], result["events"]
    assert result["ok"]


def test_recorded_vllm_figures_only_beside_runs_they_match(monkeypatch):
    """vLLM's recorded CPU step times are shown only where machine kind, dtype and shape are
    those they were measured with; elsewhere (another CPU, AVX2 emulated, float32, a GPU) none,
    and the chapter points to chapter 05's live measurement."""
    from kit.config import reference
    from kit.studies import decode_timing
    recorded = reference("vllm_cpu")["machine"]
    monkeypatch.setattr(decode_timing, "cpu_kind", lambda: dict(recorded))
    same = kit.load("cpu-real", dtype="bfloat16", device="cpu")
    assert decode_timing.vllm_cpu_reference(same)["step_ms_compiled"] == 41.5
    assert decode_timing.vllm_cpu_reference(kit.load("cpu-real", dtype="float32")) is None
    assert decode_timing.vllm_cpu_reference(kit.load("cpu-real", dtype="bfloat16",
                                                     batch_size=4)) is None
    for other in ({"pytorch_kernels": "AVX2", "onednn_max_isa": "AVX2"},
                  {"avx512_bf16": False}, {"cpu": "Intel(R) Xeon(R) Platinum 8375C"}):
        monkeypatch.setattr(decode_timing, "cpu_kind", lambda o=other: {**recorded, **o})
        assert decode_timing.vllm_cpu_reference(same) is None, other


def test_the_compute_floor_uses_float32s_rate_where_16_bit_products_are_emulated():
    """Where bf16 matmuls are emulated, compiled code multiplies in float32: the compute floor
    takes the faster of the two measured rates, never the emulated one alone."""
    from types import SimpleNamespace
    from kit.studies.decode_timing import DecodeReport
    from kit.measure.dtype_speed import DtypeSpeed
    limits = SimpleNamespace(matmul_flops_per_second=2.5e9)
    emulated = SimpleNamespace(limits=limits, dtype_speed=DtypeSpeed("bfloat16", 2.5e9, 150e9))
    native = SimpleNamespace(limits=SimpleNamespace(matmul_flops_per_second=600e9),
                             dtype_speed=DtypeSpeed("bfloat16", 600e9, 150e9))
    float32 = SimpleNamespace(limits=SimpleNamespace(matmul_flops_per_second=150e9),
                              dtype_speed=None)
    rate = DecodeReport.compute_rate.fget
    assert (rate(emulated), rate(native), rate(float32)) == (150e9, 600e9, 150e9)


def test_a_strategys_share_of_its_floor_follows_from_the_numbers_shown():
    """The roofline table's % is the floor it shows over the median it shows (not a median of
    per-step ratios over one run), and a step under its floor is flagged, in the table and the
    figure, as a measurement to repeat."""
    from kit.show.plots import floor_percent
    from kit.show.tables import floor_cell
    from kit.studies.decode_timing import StrategyTiming
    slow = StrategyTiming("eager", 4, runs=[[2e-3, 2e-3, 9e-3], [2e-3, 2e-3, 2e-3]],
                          floor_seconds=[1e-3, 1e-3, 1.2e-3])
    assert slow.median == 2e-3 and slow.median_floor_seconds == 1e-3
    assert slow.percent_of_floor == pytest.approx(50) and not slow.faster_than_floor
    assert floor_cell(slow) == "50%"
    fast = StrategyTiming("guard_free", 4, runs=[[1.41e-3] * 3], floor_seconds=[1.53e-3] * 3)
    assert fast.faster_than_floor and fast.percent_of_floor == pytest.approx(108.5, abs=0.1)
    assert floor_cell(fast) == "109% (faster than its floor: repeat the measurement)"
    bars = floor_percent({"eager": slow, "guard_free": fast}).data[0]
    assert list(bars.text) == ["50%", "109% faster than the floor: repeat"]
