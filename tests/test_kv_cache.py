from dataclasses import replace

import pytest
import torch

from kit.config import ModelConfig, load
from kit.engine.kv_cache import (KVCacheSpec, allocate_measured, estimate_activation_bytes, kv_budget,
                          layer_views, size_kv_cache, split_budget)
from kit.engine.kv_groups import with_layer_pattern
from kit.errors import ConfigError
from kit.studies.kv_cache_sizing import calculate
from kit.units import GiB

# Bytes per token, computed by hand: 2 × layers × KV heads per rank × head_dim × dtype bytes.
BY_HAND = {
    # model: {(tp, kv_cache_dtype): bytes per token}
    "tiny": {(1, "auto"): 2 * 4 * 4 * 32 * 2, (2, "auto"): 2 * 4 * 2 * 32 * 2,
             (8, "auto"): 2 * 4 * 1 * 32 * 2, (1, "fp8"): 2 * 4 * 4 * 32 * 1},
    "gemma-2b": {(1, "auto"): 18_432, (2, "auto"): 18_432, (8, "auto"): 18_432,  # 1 KV head, replicated
                 (1, "fp8"): 9_216},
    "llama-3.2-1b": {(1, "auto"): 32_768, (2, "auto"): 16_384, (8, "auto"): 4_096, (1, "fp8"): 16_384},
    "qwen2.5-0.5b": {(1, "auto"): 12_288, (2, "auto"): 6_144, (1, "fp8"): 6_144},
    "llama-3.1-8b": {(1, "auto"): 131_072, (2, "auto"): 65_536, (8, "auto"): 16_384, (1, "fp8"): 65_536},
}
CASES = [(m, tp, dt, bpt) for m, d in BY_HAND.items() for (tp, dt), bpt in d.items()]


@pytest.mark.parametrize("model,tp,kv_dtype,bytes_per_token", CASES)
def test_block_counts_by_hand(model, tp, kv_dtype, bytes_per_token):
    spec = KVCacheSpec.for_model(ModelConfig.load(model), 16, "bfloat16", kv_dtype, tp)
    assert spec.bytes_per_token == bytes_per_token and spec.bytes_per_block == 16 * bytes_per_token
    for budget in (GiB, 10 * GiB + 12345, 7 * bytes_per_token * 16 + 1):
        sizing = size_kv_cache(spec, budget, 16)
        assert sizing.num_blocks == budget // (16 * bytes_per_token)
        assert sizing.cache_bytes <= budget < sizing.cache_bytes + spec.bytes_per_block


def test_tp_that_does_not_divide_the_heads_is_refused():
    with pytest.raises(ConfigError, match="tensor_parallel_size=8 does not divide qwen2.5-0.5b's num_attention_heads=14"):
        KVCacheSpec.for_model(ModelConfig.load("qwen2.5-0.5b"), 16, "bfloat16", "auto", 8)
    with pytest.raises(ConfigError, match="does not divide"):
        load("cpu-small", tensor_parallel_size=3)


def test_pr_gemma_arithmetic():
    spec = KVCacheSpec.for_model(ModelConfig.load("gemma-2b"), 16, "bfloat16")
    assert spec.bytes_per_block == 294_912
    assert (34552 - 25752) * spec.bytes_per_block == 2_595_225_600  # 2.42 GiB


def test_vllm_style_log_line_and_concurrency():
    spec = KVCacheSpec.for_model(ModelConfig.load("tiny"), 128, "bfloat16")
    sizing = size_kv_cache(spec, 256 * 2**20, 1000, "CPU")
    assert sizing.num_blocks == 1024  # design.md: vLLM CPU gave 1024 blocks of 128 for 256 MiB
    assert sizing.max_concurrency == 1024 / 8  # ceil(1000 / 128) = 8 blocks per request
    assert sizing.log_line() == ("CPU KV cache size: 128,000 tokens, Maximum concurrency for "
                                 "1,000 tokens per request: 128.00x")


@pytest.mark.parametrize("overrides,message", [
    ({"block_size": 24}, "block_size=24 must be a power of two"),
    ({"block_size": 0}, "block_size=0 must be a positive whole number"),
    ({"kv_cache_dtype": "int3"}, "kv_cache_dtype='int3': use one of"),
    ({"kv_cache_memory_bytes": 0}, "kv_cache_memory_bytes=0 must be positive"),
])
def test_bad_kv_settings_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load("cpu-small", **overrides)


def test_budget_below_one_block_and_max_model_len_that_does_not_fit():
    spec = KVCacheSpec.from_settings(load("cpu-small"))
    with pytest.raises(ConfigError, match="does not hold one block of 32,768 bytes"):
        size_kv_cache(spec, 32_767, 1024)
    # 32 blocks, one of them vLLM's null block: 31 × 16 = 496 usable tokens
    with pytest.raises(ConfigError, match=r"max_model_len=1,024 needs 64 blocks plus vLLM's null "
                                          r"block .* holds 32 .* Lower max_model_len to 496 or less"):
        size_kv_cache(spec, 32 * 32_768, 1024)
    with pytest.raises(ConfigError, match="Lower max_model_len to 1,008"):
        size_kv_cache(spec, 64 * 32_768, 1024)  # exactly one request's blocks: refused, as vLLM does
    assert size_kv_cache(spec, 65 * 32_768, 1024).num_blocks == 65


# What vLLM 0.32 decided at start-up for 6-layer checkpoints (issue 23's table): 64 MiB,
# block 32, max_model_len 256, 2,048 batched tokens, pages of 16,384 B, window 16.
@pytest.mark.parametrize("layers,groups,blocks,tokens,concurrency", [
    ("FFFFFF", [6], 682, 21_824, 85.25),  # Qwen3: all full
    ("SSSSSS", [6], 682, 19_399, 75.78),  # Mistral: the window costs a block more at 256
    ("SFSFSF", [3, 3], 1_365, 20_555, 80.29),  # Gemma 2: two groups of 3
    ("SSSSSF", [1] * 6, 4_096, 19_784, 77.28),  # Gemma 3: six groups of one layer
])
def test_kv_cache_groups_as_vllm_sized_them(layers, groups, blocks, tokens, concurrency):
    spec = KVCacheSpec(num_layers=6, num_kv_heads=2, head_dim=64, block_size=32, dtype_bytes=2,
                       windows=tuple(16 if k == "S" else None for k in layers))
    sizing = size_kv_cache(spec, 64 * 2**20, 256, "CPU", in_flight_tokens=2048)
    assert [len(g.layers) for g in spec.groups] == groups
    assert sizing.num_blocks == blocks and sizing.num_tokens == tokens
    assert round(sizing.max_concurrency, 2) == concurrency


def test_mistral_window_multiplies_concurrency():
    """Mistral-7B-v0.1's shape, 8 GiB, block 32, max_model_len 32,768, 2,048 batched tokens:
    a request reserves 193 blocks per layer (window 4,096), not 1,024."""
    spec = KVCacheSpec.for_model(ModelConfig.load("mistral-7b-v0.1"), 32, "bfloat16")
    sizing = size_kv_cache(spec, 8 * 2**30, 32_768, in_flight_tokens=2048)
    assert sizing.blocks_per_request == 193 and spec.page_bytes * 193 == 25_296_896
    assert round(sizing.max_concurrency, 2) == 10.61
    full = size_kv_cache(replace(spec, windows=()), 8 * 2**30, 32_768)
    assert round(full.max_concurrency, 2) == 2.0


def test_layer_patterns_of_the_calculator():
    """The calculator's patterns turn any model's layers sliding or full, and the kit's groups
    follow (a 1-in-6 pattern on Llama-3.2-1B's 16 layers: 2 full, 14 sliding, group size 2)."""
    arch = ModelConfig.load("llama-3.2-1b")
    six = with_layer_pattern(arch, 6, 1024)
    assert [i for i in range(16) if not six.window(i)] == [5, 11]
    assert [len(g.layers) for g in KVCacheSpec.for_model(six, 16, "bfloat16").groups] == [2] * 8
    assert with_layer_pattern(arch, None, 512).window(0) == 512
    assert with_layer_pattern(six, 1).layer_types == () and with_layer_pattern(six, 0) is six
    split, _ = calculate(load("cpu-small"), 10**6, "mistral-7b-v0.1", capacity_bytes=32 * GiB,
                         gpu_memory_utilization=0.9, block_size=32, kv_cache_dtype="auto",
                         max_model_len=32_768, full_every=1)
    assert split.sizing.spec.windows == () and split.sizing.blocks_per_request == 1024


def test_explicit_kv_cache_size_overrides_the_profile():
    assert kv_budget(load("cpu-small", kv_cache_memory_bytes="256MiB"), "compiled", 10**9) == \
        (256 * 2**20, "kv_cache_memory_bytes")
    assert kv_budget(load("cpu-small"), "compiled", 10**9) == (10**9, "the compiled memory profile")


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8", "float32"])
def test_allocated_bytes_equal_predicted(kv_dtype):
    s = load("cpu-small", kv_cache_dtype=kv_dtype)
    spec = KVCacheSpec.from_settings(s)
    sizing = size_kv_cache(spec, 8 * 2**20 + 5, 64)
    cache, allocated = allocate_measured(spec, sizing.num_blocks, s.dtype, "cpu")
    assert allocated == sizing.cache_bytes == cache.numel() * cache.element_size()
    views = layer_views(cache)
    assert len(views) == 4 and views[1].shape == (2, sizing.num_blocks, 16, 4, 32)
    views[2][1, 0, 0, 0, 0] = 1  # a write through a view lands in the one tensor
    assert cache[2, 1, 0, 0, 0, 0].float() == 1


def test_groups_share_one_allocation_as_vllm_allocates_it():
    """Gemma-3-1B's shape at a small budget: seven groups of at most four layers share four
    slices, and every layer's view is the slice its place in its group names."""
    spec = KVCacheSpec.for_model(ModelConfig.load("gemma-3-1b"), 16, "bfloat16")
    sizing = size_kv_cache(spec, 2**22, 64, in_flight_tokens=64)
    cache, allocated = allocate_measured(spec, sizing.num_blocks, "bfloat16", "cpu")
    assert cache.shape[0] == spec.group_size == 4 and allocated == sizing.cache_bytes
    views = layer_views(cache, spec)
    assert len(views) == 26 and all(views[g.layers[j]].data_ptr() == cache[j].data_ptr()
                                    for g in spec.groups for j in range(len(g.layers)))


def test_budget_split_and_estimate():
    arch = ModelConfig.load("llama-3.1-8b")
    act = estimate_activation_bytes(arch, 8192, 256, 2)
    split = split_budget(arch, "bfloat16", 80 * GiB, 0.9, act, 16, "auto", 8192, 2)
    assert split.weights_bytes == arch.num_parameters() * 2 // 2
    assert split.kv_bytes == int(80 * GiB * 0.9) - split.weights_bytes - act
    assert split.sizing.num_blocks == split.kv_bytes // (16 * 65_536)


def test_the_allocator_counts_the_concurrency_the_formula_divides():
    from kit.studies.kv_cache_sizing import requests_that_fit
    settings = load("cpu-small", max_model_len=1000, block_size=16)
    spec = KVCacheSpec.from_settings(settings)
    for blocks in (64, 126, 127, 1108):
        sizing = size_kv_cache(spec, blocks * spec.bytes_per_block + 5, 63 * 16)
        assert requests_that_fit(blocks, settings) == int(sizing.max_concurrency) == blocks // 63


def test_windowed_caches_on_the_cpu_take_vllms_32_token_blocks():
    """vLLM's CPU attention gives window layers blocks in multiples of 32, and the whole cache
    is then sized at that block; full-attention models and CUDA keep block_size."""
    mistral = ModelConfig.load("mistral-7b-v0.1")
    assert KVCacheSpec.for_model(mistral, 16, "bfloat16", device="cpu").block_size == 32
    assert KVCacheSpec.for_model(mistral, 16, "bfloat16", device="cuda").block_size == 16
    assert KVCacheSpec.for_model(mistral, 64, "bfloat16", device="cpu").block_size == 64
    assert KVCacheSpec.for_model(ModelConfig.load("tiny"), 16, "bfloat16",
                                 device="cpu").block_size == 16
