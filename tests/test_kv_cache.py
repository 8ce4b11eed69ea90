import pytest
import torch

from kit.config import ModelConfig, load, with_layer_pattern
from kit.engine.budget import estimate_activation_bytes, kv_budget, weights_budget
from kit.engine.kv_cache import (KVCacheConfig, KVCacheLayout, allocate_measured,
                                 kv_cache_config, layer_views)
from kit.engine.kv_groups import kv_cache_groups
from kit.engine.kv_specs import FullAttentionSpec, SlidingWindowSpec, attention_specs
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
    layout = KVCacheLayout.for_model(ModelConfig.load(model), 16, "bfloat16", kv_dtype, tp)
    assert layout.bytes_per_token == bytes_per_token
    assert layout.bytes_per_block == 16 * bytes_per_token
    for budget in (GiB, 10 * GiB + 12345, 7 * bytes_per_token * 16 + 1):
        config = kv_cache_config(layout, budget, 16)
        assert config.num_blocks == budget // (16 * bytes_per_token)
        assert config.cache_bytes <= budget < config.cache_bytes + layout.bytes_per_block


def test_tp_that_does_not_divide_the_heads_is_refused():
    with pytest.raises(ConfigError, match="tensor_parallel_size=8 does not divide qwen2.5-0.5b's num_attention_heads=14"):
        KVCacheLayout.for_model(ModelConfig.load("qwen2.5-0.5b"), 16, "bfloat16", "auto", 8)
    with pytest.raises(ConfigError, match="does not divide"):
        load("cpu-small", tensor_parallel_size=3)


def test_pr_gemma_arithmetic():
    layout = KVCacheLayout.for_model(ModelConfig.load("gemma-2b"), 16, "bfloat16")
    assert layout.bytes_per_block == 294_912
    assert (34552 - 25752) * layout.bytes_per_block == 2_595_225_600  # 2.42 GiB


def test_vllm_style_log_line_and_concurrency():
    layout = KVCacheLayout.for_model(ModelConfig.load("tiny"), 128, "bfloat16")
    config = kv_cache_config(layout, 256 * 2**20, 1000, "CPU")
    assert config.num_blocks == 1024  # design.md: vLLM CPU gave 1024 blocks of 128 for 256 MiB
    assert config.max_concurrency == 1024 / 8  # ceil(1000 / 128) = 8 blocks per request
    assert config.log_line() == ("CPU KV cache size: 128,000 tokens, Maximum concurrency for "
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
    layout = KVCacheLayout.for_settings(load("cpu-small"))
    with pytest.raises(ConfigError, match="does not hold one block of 32,768 bytes"):
        kv_cache_config(layout, 32_767, 1024)
    # 32 blocks, one of them vLLM's null block: 31 × 16 = 496 usable tokens
    with pytest.raises(ConfigError, match=r"max_model_len=1,024 needs 64 blocks plus vLLM's null "
                                          r"block .* holds 32 .* Lower max_model_len to 496 or less"):
        kv_cache_config(layout, 32 * 32_768, 1024)
    with pytest.raises(ConfigError, match="Lower max_model_len to 1,008"):
        kv_cache_config(layout, 64 * 32_768, 1024)  # one request's blocks: refused, as by vLLM
    assert kv_cache_config(layout, 65 * 32_768, 1024).num_blocks == 65


# What vLLM 0.32 decided at start-up for 6-layer checkpoints (issue 23's table): 64 MiB,
# block 32, max_model_len 256, 2,048 batched tokens, pages of 16,384 B, window 16.
@pytest.mark.parametrize("layers,groups,blocks,tokens,concurrency", [
    ("FFFFFF", [6], 682, 21_824, 85.25),  # Qwen3: all full
    ("SSSSSS", [6], 682, 19_399, 75.78),  # Mistral: the window costs a block more at 256
    ("SFSFSF", [3, 3], 1_365, 20_555, 80.29),  # Gemma 2: two groups of 3
    ("SSSSSF", [1] * 6, 4_096, 19_784, 77.28),  # Gemma 3: six groups of one layer
])
def test_kv_cache_groups_as_vllm_sized_them(layers, groups, blocks, tokens, concurrency):
    specs = attention_specs([16 if k == "S" else None for k in layers], 32, 2, 64, 2)
    layout = KVCacheLayout(kv_cache_groups(specs), 32, 32, "bfloat16")
    config = kv_cache_config(layout, 64 * 2**20, 256, "CPU", in_flight_tokens=2048)
    assert [len(g.layers) for g in layout.groups] == groups
    assert config.num_blocks == blocks and config.num_tokens == tokens
    assert round(config.max_concurrency, 2) == concurrency
    # vLLM's KVCacheTensors: one per place in the widest group, shared by a layer of each group
    assert [layers for _, layers in config.tensors] == [
        tuple(g.layers[j] for g in layout.groups) for j in range(max(groups))]
    assert sum(size for size, _ in config.tensors) == config.cache_bytes


def test_mistral_window_multiplies_concurrency():
    """Mistral-7B-v0.1's shape, 8 GiB, block 32, max_model_len 32,768, 2,048 batched tokens:
    a request reserves 193 blocks per layer (window 4,096), not 1,024."""
    arch = ModelConfig.load("mistral-7b-v0.1")
    layout = KVCacheLayout.for_model(arch, 32, "bfloat16")
    config = kv_cache_config(layout, 8 * 2**30, 32_768, in_flight_tokens=2048)
    assert config.blocks_per_request == 193 and layout.page_size_bytes * 193 == 25_296_896
    assert round(config.max_concurrency, 2) == 10.61
    full = KVCacheLayout.for_model(with_layer_pattern(arch, 1), 32, "bfloat16")
    assert round(kv_cache_config(full, 8 * 2**30, 32_768).max_concurrency, 2) == 2.0


def test_layer_patterns_of_the_calculator():
    """The calculator's patterns turn any model's layers sliding or full, and the kit's groups
    follow (a 1-in-6 pattern on Llama-3.2-1B's 16 layers: 2 full, 14 sliding, group size 2)."""
    arch = ModelConfig.load("llama-3.2-1b")
    six = with_layer_pattern(arch, 6, 1024)
    assert [i for i in range(16) if not six.window(i)] == [5, 11]
    assert [len(g.layers) for g in KVCacheLayout.for_model(six, 16, "bfloat16").groups] == [2] * 8
    assert with_layer_pattern(arch, None, 512).window(0) == 512
    assert with_layer_pattern(six, 1).layer_types == () and with_layer_pattern(six, 0) is six
    calc = calculate(load("cpu-small"), 10**6, "mistral-7b-v0.1", capacity_bytes=32 * GiB,
                     gpu_memory_utilization=0.9, block_size=32, kv_cache_dtype="auto",
                     max_model_len=32_768, full_every=1)
    assert not calc.config.layout.has_windows and calc.config.blocks_per_request == 1024
    assert calc.activations == "estimated"


def test_explicit_kv_cache_size_overrides_the_profile():
    assert kv_budget(load("cpu-small", kv_cache_memory_bytes="256MiB"), "compiled", 10**9) == \
        (256 * 2**20, "kv_cache_memory_bytes")
    assert kv_budget(load("cpu-small"), "compiled", 10**9) == (10**9, "the compiled memory profile")


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8", "float32"])
def test_allocated_bytes_equal_predicted(kv_dtype):
    s = load("cpu-small", kv_cache_dtype=kv_dtype)
    layout = KVCacheLayout.for_settings(s)
    config = kv_cache_config(layout, 8 * 2**20 + 5, 64)
    cache, allocated = allocate_measured(layout, config.num_blocks, "cpu")
    assert allocated == config.cache_bytes == cache.numel() * cache.element_size()
    views = layer_views(cache, layout)
    assert len(views) == 4 and views[1].shape == (2, config.num_blocks, 16, 4, 32)
    views[2][1, 0, 0, 0, 0] = 1  # a write through a view lands in the one tensor
    assert cache[2, 1, 0, 0, 0, 0].float() == 1


def test_groups_share_one_allocation_as_vllm_allocates_it():
    """Gemma-3-1B's shape at a small budget: seven groups of at most four layers share four
    slices, and every layer's view is the slice its place in its group names."""
    layout = KVCacheLayout.for_model(ModelConfig.load("gemma-3-1b"), 16, "bfloat16")
    config = kv_cache_config(layout, 2**22, 64, in_flight_tokens=64)
    cache, allocated = allocate_measured(layout, config.num_blocks, "cpu")
    assert cache.shape[0] == layout.group_size == 4 and allocated == config.cache_bytes
    views = layer_views(cache, layout)
    assert len(views) == 26 and all(views[g.layers[j]].data_ptr() == cache[j].data_ptr()
                                    for g in layout.groups for j in range(len(g.layers)))


def test_budget_split_and_estimate():
    arch = ModelConfig.load("llama-3.1-8b")
    act = estimate_activation_bytes(arch, 8192, 256, 2)
    budget = weights_budget(arch, "bfloat16", 80 * GiB, 0.9, 2, act)
    assert budget.weights_bytes == arch.num_parameters() * 2 // 2
    assert budget.kv_cache_bytes == int(80 * GiB * 0.9) - budget.weights_bytes - act
    layout = KVCacheLayout.for_model(arch, 16, "bfloat16", "auto", 2)
    assert KVCacheConfig(layout, budget.kv_cache_bytes, 8192).num_blocks == \
        budget.kv_cache_bytes // (16 * 65_536)


def test_the_block_manager_counts_the_concurrency_the_formula_divides():
    """Requests of max_model_len tokens handed blocks until none are left: vLLM's concurrency,
    ⌊num_blocks / blocks per request⌋, but one fewer where they divide evenly, since vLLM's
    line counts its null block, which the manager never hands out."""
    from kit.studies.kv_cache_sizing import requests_that_fit
    layout = KVCacheLayout.for_settings(load("cpu-small", max_model_len=1000, block_size=16))
    for blocks, admitted in ((64, 1), (126, 1), (127, 2), (1108, 17), (1134, 17)):
        config = kv_cache_config(layout, blocks * layout.bytes_per_block + 5, 63 * 16)
        assert requests_that_fit(config) == admitted == (blocks - 1) // 63
        assert int(config.max_concurrency) - admitted == (blocks % 63 == 0)


@pytest.mark.parametrize("model", ["tiny-mamba", "tiny-gdn"])
def test_a_hybrids_block_manager_admits_vllms_concurrency_without_prefix_caching(model):
    """The manager keeps one state a request (mamba_cache_mode "none"): it admits what vLLM's
    line says with prefix caching off, more than its default line ("align": 2-3 states)."""
    from kit.studies.block_tables_by_step import windowed_example
    from kit.studies.kv_cache_sizing import block_manager_config, requests_that_fit
    settings = load("cpu-small", model=model)
    default = kv_cache_config(KVCacheLayout.for_settings(settings), 2**26,
                              settings.max_model_len, "CPU")
    run = block_manager_config(default, settings)
    assert run.num_blocks == default.num_blocks and run.max_concurrency > default.max_concurrency
    null_short = run.num_blocks % run.blocks_per_request == 0
    assert requests_that_fit(run) == int(run.max_concurrency) - null_short
    assert windowed_example(settings.arch).family == "llama"  # no windows on recurrent layers


def test_windowed_caches_on_the_cpu_take_vllms_32_token_blocks():
    """vLLM's CPU attention gives window layers blocks in multiples of 32, and the whole cache
    is then sized at that block; full-attention models and CUDA keep block_size."""
    mistral = ModelConfig.load("mistral-7b-v0.1")
    cpu = KVCacheLayout.for_model(mistral, 16, "bfloat16", device="cpu")
    assert cpu.block_size == 32 == cpu.groups[0].spec.block_size
    assert "block_size 16 runs as 32" in cpu.block_size_note()
    cuda = KVCacheLayout.for_model(mistral, 16, "bfloat16", device="cuda")
    assert cuda.block_size == 16 and cuda.block_size_note() is None
    assert KVCacheLayout.for_model(mistral, 64, "bfloat16", device="cpu").block_size == 64
    assert KVCacheLayout.for_model(ModelConfig.load("tiny"), 16, "bfloat16",
                                   device="cpu").block_size == 16


def test_each_kind_of_layer_answers_vllms_questions():
    """A full layer and a window of 100 at blocks of 16, 2 KV heads of 64 in bf16 (512 B a
    token): pages, reservations (max_model_len 1,000, 256 tokens in flight), skipped and read
    tokens, as vLLM's specs answer them."""
    full = FullAttentionSpec(16, num_kv_heads=2, head_size=64, dtype_bytes=2)
    window = SlidingWindowSpec(16, num_kv_heads=2, head_size=64, dtype_bytes=2,
                               sliding_window=100)
    assert full.bytes_per_token == window.bytes_per_token == 512
    assert full.page_size_bytes == 16 * 512
    assert full.blocks_per_request(1000, 256) == 63  # ceil(1000 / 16)
    assert window.blocks_per_request(1000, 256) == 23 + 1  # ceil((99 + 256) / 16), one more
    assert window.blocks_per_request(200, 256) == 13 + 1  # capped at max_model_len
    assert [full.num_skipped_tokens(n) for n in (50, 500)] == [0, 0]
    assert [window.num_skipped_tokens(n) for n in (50, 500)] == [0, 401]
    assert [window.tokens_read(n) for n in (50, 500)] == [50, 100]
    with pytest.raises(ValueError, match="in_flight_tokens"):
        window.blocks_per_request(1000, 0)


def test_a_model_that_does_not_fit_says_by_how_much_and_what_to_give():
    """At the notebook's 96 MiB a 7B model's weights alone are over the budget: the calculator
    says how much device_memory would hold one request of max_model_len, and at that memory
    (rounded up) the model fits."""
    s = load("cpu-small")
    knobs = dict(model="mistral-7b-v0.1", gpu_memory_utilization=0.9, block_size=16,
                 kv_cache_dtype="auto", max_model_len=1024)
    tight = calculate(s, 10 * 2**20, capacity_bytes=96 * 2**20, **knobs)
    advice = tight.fit_advice()
    assert tight.missing_bytes > 0 and advice.startswith("Does not fit: weights 13.49 GiB")
    need = float(advice.split("Give device_memory at least ")[1].split(" GiB")[0])
    assert calculate(s, 10 * 2**20, capacity_bytes=int((need + 0.01) * GiB),
                     **knobs).fit_advice() is None
    assert calculate(s, 10 * 2**20, capacity_bytes=int((need - 0.05) * GiB),
                     **knobs).fit_advice() is not None


def test_the_calculator_moves_its_memory_to_where_a_chosen_model_is_served():
    """Choosing a model that does not fit the notebook's 96 MiB moves the memory to the
    smallest common GPU that holds it (16 GiB for a 7B model in bf16), saying so; choosing
    the notebook's model again brings its own memory back."""
    from kit.show.widgets import kv_calculator
    from kit.studies.kv_cache_sizing import Calculator
    s = load("cpu-small")
    box = kv_calculator(s, 96 * 2**20, Calculator(s, 10 * 2**20), {"as configured": 0}).box
    model, memory, numbers = box.children[0], box.children[2], box.children[-2]
    assert "blocks" in numbers.value and "moved" not in numbers.value
    model.value = "mistral-7b-v0.1"
    assert memory.value == 16 * GiB and memory.label == "16 GiB"
    assert "device_memory moved to 16 GiB" in numbers.value
    assert "Does not fit" not in numbers.value and "KV cache size" in numbers.value
    model.value = s.model
    assert memory.value == 96 * 2**20 and "moved" not in numbers.value


def test_the_calculator_says_which_block_it_sizes_at_and_what_windowed_tokens_are():
    """On the CPU a windowed model's cache runs at 32-token blocks whatever block_size says,
    and its tokens grow with max_model_len at fixed blocks: both said under the numbers."""
    from kit.show.widgets import numbers_html
    s = load("cpu-small")
    knobs = dict(model="gemma-3-1b", capacity_bytes=24 * GiB, gpu_memory_utilization=0.9,
                 block_size=16, kv_cache_dtype="auto")
    short, long = (calculate(s, 10 * 2**20, max_model_len=n, **knobs) for n in (1024, 8192))
    assert short.config.layout.block_size == 32
    html = numbers_html(short)
    assert "block_size 16 runs as 32" in html and "tokens = concurrency × max_model_len" in html
    assert long.config.num_tokens > short.config.num_tokens  # the same memory, more tokens
    dense = numbers_html(calculate(s, 10 * 2**20, max_model_len=1024,
                                   **{**knobs, "model": "llama-3.2-1b"}))
    assert "runs as" not in dense and "tokens = concurrency" not in dense
