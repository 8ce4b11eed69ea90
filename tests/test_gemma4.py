"""Gemma 4's text decoder (`gemma4_text`) read and sized: its parameters counted as
transformers builds them (its mixture of experts too), its KV-shared layers given no cache, its
wider full layers their own spec, inconsistent or unknown keys refused by name. (Its grid against vLLM's
own sizing is test_vllm's, its parity with transformers test_checkpoint's.)"""
import json

import pytest
import torch

from kit.config import MODELS_DIR, ModelConfig
from kit.engine.kv_cache import KVCacheLayout, kv_cache_config
from kit.errors import ConfigError


def transformers_parameters(folder) -> int:
    """transformers' own count of the folder's Gemma4ForCausalLM, built on the meta device."""
    transformers = pytest.importorskip("transformers")
    config = transformers.Gemma4TextConfig.from_pretrained(folder)
    with torch.device("meta"):
        model = transformers.Gemma4ForCausalLM(config)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", ["tiny-gemma4", "gemma-4-e2b"])
def test_the_parameter_count_is_transformers(tmp_path, name):
    arch = ModelConfig.load(name)
    (tmp_path / "config.json").write_text(json.dumps(arch.hf_dict()))
    assert arch.num_parameters() == transformers_parameters(tmp_path)


def test_a_config_transformers_wrote_reads_its_per_layer_config(tmp_path):
    """transformers 5.19 writes the global heads as `per_layer_config`, not global_head_dim."""
    transformers = pytest.importorskip("transformers")
    arch = ModelConfig.load("tiny-gemma4")
    transformers.Gemma4TextConfig(**{k: v for k, v in arch.hf_dict().items()
                                     if k != "model_type"}).save_pretrained(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert "global_head_dim" not in written and written["per_layer_config"]
    again = ModelConfig.load(str(tmp_path / "config.json"))
    assert (again.global_head_dim, again.num_global_key_value_heads) == (128, 1)
    assert again.num_parameters() == arch.num_parameters() == transformers_parameters(tmp_path)
    written["per_layer_config"]["0"] = {"head_dim": 128}
    (tmp_path / "config.json").write_text(json.dumps(written))
    with pytest.raises(ConfigError, match="per_layer_config"):
        ModelConfig.load(str(tmp_path / "config.json"))


def test_kv_shared_layers_read_their_source_and_have_no_spec():
    arch = ModelConfig.load("tiny-gemma4")  # s s F s | s F, the last two shared
    assert [arch.kv_source(i) for i in range(6)] == [0, 1, 2, 3, 3, 2]
    assert [arch.has_v_proj(i) for i in range(6)] == [True, True, False, True, False, False]
    assert [arch.layer_head_dim(i) for i in range(6)] == [64, 64, 128, 64, 64, 128]
    layout = KVCacheLayout.for_model(arch, 32, "bfloat16")
    assert sorted(i for g in layout.groups for i in g.layers) == [0, 1, 2, 3]
    assert layout.shared == ((4, 3), (5, 2)) and layout.num_layers == 6
    assert layout.place(5) == layout.place(2) and layout.place(4) == layout.place(3)
    # sliding: 2 heads × 64, full: 1 × 128: one page size, the same block
    assert {s.page_size_bytes for s in layout.specs} == {32 * 2 * 128 * 2}
    # the shared layers cost no bytes: 4 layers' pages per token, not 6
    assert layout.bytes_per_token == 4 * 2 * 128 * 2


def test_wider_global_heads_make_the_sliding_blocks_wider():
    """gemma-4-e2b: 1 KV head of 256 on sliding layers, of 512 on full ones; vLLM makes one
    page size by giving the sliding layers twice the tokens per block."""
    layout = KVCacheLayout.for_model(ModelConfig.load("gemma-4-e2b"), 32, "bfloat16")
    blocks = {g.window: g.spec.block_size for g in layout.groups}
    assert blocks == {512: 64, None: 32} and len(layout.groups) == 5
    assert all(len(g.layers) == 3 for g in layout.groups)
    config = kv_cache_config(layout, 2**30, 4096, "CPU", 2048)
    assert config.num_blocks == 2**30 // (3 * 32 * 2 * 512 * 2)


def test_its_mixture_of_experts_is_counted_as_transformers_counts_it(tmp_path):
    """Every layer: the dense MLP, the router (projection, input scale, per-expert scale), the
    experts and three more norms."""
    hf = json.loads((MODELS_DIR / "tiny-gemma4.json").read_text())
    hf.update(enable_moe_block=True, num_experts=16, top_k_experts=4, moe_intermediate_size=64)
    (tmp_path / "config.json").write_text(json.dumps(hf))
    arch = ModelConfig.load(str(tmp_path / "config.json"))
    assert all(map(arch.is_moe, range(6))) and arch.num_experts_per_tok == 4
    assert arch.num_parameters() == transformers_parameters(tmp_path)
    assert arch.experts_parameters() == 6 * 16 * 3 * 256 * 64
    assert arch.active_parameters() == arch.num_parameters() - 6 * 12 * 3 * 256 * 64
    assert ModelConfig.from_dict(arch.hf_dict(), "again").num_parameters() == \
        arch.num_parameters()


@pytest.mark.parametrize("change,message", [
    ({"enable_moe_block": True, "num_experts": 8, "top_k_experts": 9,
      "moe_intermediate_size": 64}, "top_k_experts no larger"),
    ({"enable_moe_block": True}, "enable_moe_block needs"),
    ({"num_experts": 8}, "mixture-of-experts keys"),
    ({"num_kv_shared_layers": 6}, "num_kv_shared_layers"),
    ({"altup_num_inputs": 4}, "altup_num_inputs"),
    ({"use_bidirectional_attention": "all"}, "use_bidirectional_attention='all'"),
    ({"rope_theta": 1e6}, "rope_theta"),
    ({"rope_parameters": {"full_attention": {"rope_type": "yarn", "rope_theta": 1e6}}},
     "proportional"),
])
def test_what_the_kit_does_not_build_is_refused_by_name(change, message):
    hf = json.loads((MODELS_DIR / "tiny-gemma4.json").read_text())
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_dict({**hf, **change}, "g4")


def test_a_decode_steps_bytes_count_the_shared_layers_reads_not_their_writes():
    """The roofline: KV-shared layers write nothing but read their source's cache again, and
    the per-layer table is read only at the batch's rows, as an untied embedding is."""
    from kit.measure.roofline import decode_step_cost
    arch = ModelConfig.load("tiny-gemma4")
    layout = KVCacheLayout.for_model(arch, 32, "bfloat16")
    cost = decode_step_cost(arch, 2, layout.specs, [100, 200])
    per_token = 2 * 128 * 2  # every layer's K and V: 2 × 64 or 1 × 128, bfloat16
    assert cost.kv_write_bytes == 2 * 4 * per_token
    # sliding layers 0, 1, 3 and 4 (reading 3) see 64 tokens, full 2 and 5 (reading 2) all
    assert cost.kv_read_bytes == per_token * (4 * 2 * 63 + 2 * (99 + 199))
    table = arch.vocab_size_per_layer_input * arch.per_layer_width
    assert cost.weight_bytes == 2 * (arch.num_parameters() - table + 2 * arch.per_layer_width
                                     + 2 * arch.hidden_size)


def test_the_issues_measured_line_for_its_gemma4_checkpoint():
    """Issue 34's float32 gemma4_text checkpoint (6 layers, the last 2 KV-shared, K = V, a
    global head of 128 beside sliding heads of 2 × 64, per-layer embeddings; test_checkpoint's
    GEMMA4): vLLM gave the two shared layers no spec, made 3 sliding groups and 1 full of one
    layer each, and logged 2,048 blocks, "14,979 tokens, 58.51x" for 64 MiB at block 32 and
    max_model_len 256. The kit's arithmetic gives the same."""
    kinds = ["sliding_attention", "sliding_attention", "full_attention"] * 2
    arch = ModelConfig.from_dict({
        "model_type": "gemma4_text", "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 64, "global_head_dim": 128, "num_global_key_value_heads": 1,
        "attention_k_eq_v": True, "num_kv_shared_layers": 2, "hidden_size_per_layer_input": 16,
        "vocab_size_per_layer_input": 1000, "vocab_size": 1000, "sliding_window": 8,
        "layer_types": kinds}, "issue-34")
    layout = KVCacheLayout.for_model(arch, 32, "float32", device="cpu")
    assert sorted(g.layers for g in layout.groups) == [(0,), (1,), (2,), (3,)]
    config = kv_cache_config(layout, 64 * 2**20, 256, "CPU", 2048)
    assert config.num_blocks == 2048
    assert config.log_line() == ("CPU KV cache size: 14,979 tokens, Maximum concurrency for "
                                 "256 tokens per request: 58.51x")


def test_vision_only_bidirectional_attention_leaves_the_text_decoder_causal():
    hf = json.loads((MODELS_DIR / "tiny-gemma4.json").read_text())
    arch = ModelConfig.from_dict({**hf, "use_bidirectional_attention": "vision"}, "g4")
    assert arch == ModelConfig.from_dict(hf, "g4")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_wider_global_layers_decode_at_their_own_block_size(dtype):
    """tiny-gemma4-wide: global layers with twice the sliding ones' bytes a token (two global KV
    heads of 128 against two of 64): vLLM gives the sliding groups twice the tokens per block,
    one page size. The cache is allocated in the sliding layers' rows, one page a block id in
    every group (a global layer writes a token as 2 rows); each group's table holds its own
    ⌈n ÷ its block⌉ blocks; the paged decode (prompts ending inside and on both groups' blocks,
    one past the window of 64, steps crossing block edges) equals the no-cache reference."""
    from kit.engine.decode import batch_for_run, generate, make_prompts
    from kit.engine.model import build_model
    from kit.engine.no_cache import check_against_no_cache
    arch = ModelConfig.load("tiny-gemma4-wide")
    layout = KVCacheLayout.for_model(arch, 4, dtype)
    assert layout.decode_refusal() is None
    assert {g.window: g.spec.block_size for g in layout.groups} == {64: 8, None: 4}
    assert len({g.spec.page_size_bytes for g in layout.groups}) == 1
    config = kv_cache_config(layout, 1 << 22, 256, in_flight_tokens=64)
    assert layout.tensor_shape(config.num_blocks)[3:] == (8, 2, 64)
    assert config.cache_bytes == config.num_blocks * 8 * 2 * 2 * 64 * layout.group_size * (
        4 if dtype == "float32" else 2)
    lengths, steps = [3, 8, 13, 70], 9
    batch = batch_for_run(layout, lengths, steps, "cpu")
    model = build_model(arch, dtype, "cpu", seed=0)
    prompts = make_prompts(lengths, arch.vocab_size, seed=1)
    run = generate(model, batch, prompts, steps)
    for i, n in enumerate(lengths):
        assert [len(t) for t in batch.allocator.tables[i]] == [
            -(-(n + steps) // g.spec.block_size) for g in layout.groups]
    result = check_against_no_cache(model, prompts, run, dtype)
    assert result.ok and result.agreement_up_to_ties > 0.9, result.errors
    assert dtype != "float32" or result.max_error < 1e-5


def test_global_layers_whose_tokens_fill_no_whole_rows_are_sized_but_not_decoded():
    """Global layers of 3 KV heads of 64 beside 2 sliding ones (1.5 times the bytes a token):
    vLLM pads the sliding layers' pages to the global ones'. The kit sizes and allocates that
    cache; its paged decode, which writes a global token as whole rows of the cache, refuses,
    saying why."""
    from kit.engine.decode import PagedBatch
    from kit.engine.kv_cache import allocate
    arch = ModelConfig.from_dict({**json.loads((MODELS_DIR / "tiny-gemma4.json").read_text()),
                                  "num_global_key_value_heads": 3, "global_head_dim": 64}, "g4")
    layout = KVCacheLayout.for_model(arch, 16, "float32")
    assert {g.spec.page_size_bytes for g in layout.groups} == {16 * 2 * 3 * 64 * 4}
    config = kv_cache_config(layout, 1 << 22, 256, in_flight_tokens=64)
    cache = allocate(layout, config.num_blocks, "cpu")
    with pytest.raises(ConfigError, match="whole multiple of the narrowest"):
        PagedBatch(layout, cache, [100], width=8)
