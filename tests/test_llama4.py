"""Llama 4's text decoder (`llama4_text`, issue 34): its config.json read as transformers'
Llama4TextConfig reads it (or refused where vLLM would build another model), chunked local
attention sized by vLLM's own `ChunkedLocalAttentionSpec` arithmetic, and the decoder against
transformers on a checkpoint transformers wrote, each of its parts shown to matter."""
import dataclasses
import json
from types import SimpleNamespace

import pytest
import torch

import kit
from kit.config import CHUNKED, FULL, ModelConfig
from kit.engine.kv_cache import KVCacheLayout, kv_cache_config
from kit.engine.kv_specs import ChunkedLocalAttentionSpec
from kit.errors import ConfigError
from tests.test_checkpoint import (CASES, SMALL, config_file, decode_error, checkpoint,
                                   kit_and_reference_logits, kit_model, prompt_ids,
                                   relative_error, spread)

CASE = "llama4-chunked-nope-moe"


def test_a_bare_config_reads_llama4_text_configs_defaults():
    """Keys left out mean what Llama4TextConfig assumes: every 4th layer NoPE and full, the
    others chunked over 8,192, every layer MoE (16 experts, top 1), qk-norm, tuning on."""
    from transformers import AutoConfig
    hf = {"model_type": "llama4_text", "hidden_size": 64, "intermediate_size": 96,
          "num_hidden_layers": 8, "num_attention_heads": 4, "vocab_size": 101}
    arch, ref = ModelConfig.from_dict(hf, "bare"), AutoConfig.for_model(**hf)
    assert list(arch.layer_types) == ref.layer_types == [CHUNKED] * 3 + [FULL] + [CHUNKED] * 3 \
        + [FULL]
    assert [int(arch.uses_rope(i)) for i in range(8)] == ref.no_rope_layers
    assert [i for i in range(8) if arch.is_moe(i)] == ref.moe_layers
    assert (arch.attention_chunk_size, arch.num_experts, arch.num_experts_per_tok,
            arch.qk_l2_norm, arch.floor_scale, arch.attn_scale, arch.rope_theta,
            arch.intermediate_size_mlp, arch.head_dim, arch.max_position_embeddings) == (
        ref.attention_chunk_size, ref.num_local_experts, ref.num_experts_per_tok,
        ref.use_qk_norm, ref.floor_scale, ref.attn_scale, ref.rope_parameters["rope_theta"],
        ref.intermediate_size_mlp, ref.head_dim, ref.max_position_embeddings)


@pytest.mark.parametrize("changes,message", [
    ({"model_type": "llama4"}, "multimodal model .*text decoder, model_type 'llama4_text'"),
    ({"moe_layers": [0, 1]}, "moe_layers \\[0, 1\\] differ from every "
                             "interleave_moe_layer_step=2-th layer"),
    ({"layer_types": ["full_attention"] * 4}, "layer_types .* differ from no_rope_layers'"),
    ({"attention_chunk_size": None}, "attention_chunk_size must be a positive whole number"),
    ({"hidden_act": "gelu"}, "SiLU MLPs and no attention biases"),
    ({"attention_bias": True}, "SiLU MLPs and no attention biases"),
    ({"no_rope_layers": [1, 2, 1, 0]}, "no_rope_layers must give 1 \\(RoPE\\) or 0"),
    ({"interleave_moe_layer_step": 0}, "interleave_moe_layer_step must be a positive"),
    ({"moe_intermediate_size": 32}, "keys the kit's decoder does not build: "
                                    "\\['moe_intermediate_size'\\]"),
])
def test_llama4_keys_that_would_build_another_model_are_refused(tmp_path, changes, message):
    """Refused by name before any work: the multimodal wrapper (pointing at its text decoder),
    and the values on which vLLM and transformers would build different models."""
    with pytest.raises(ConfigError, match=message):
        ModelConfig.load(str(config_file(tmp_path, **{**CASES[CASE], **changes})))


def test_the_kits_config_json_reads_back_as_the_same_model():
    arch = ModelConfig.load("tiny-llama4")
    again = ModelConfig.from_dict(json.loads(json.dumps(arch.hf_dict())), arch.name)
    assert again == arch
    off = dataclasses.replace(arch, floor_scale=None, attn_scale=None)
    assert ModelConfig.from_dict(off.hf_dict(), arch.name) == off


@pytest.mark.vllm
@pytest.mark.parametrize("chunk,block,computed", [(8, 4, 13), (8, 4, 8), (8, 4, 7),
                                                   (32, 16, 100), (8192, 32, 40_000)])
def test_chunked_spec_is_vllms(chunk, block, computed):
    """Blocks a request reserves and tokens it skips, against vLLM's own methods
    (`ChunkedLocalAttentionSpec.max_admission_blocks_per_request`,
    `ChunkedLocalAttentionManager.get_num_skipped_tokens`), at several lengths and in-flight
    tokens."""
    from vllm.v1.core.single_type_kv_cache_manager import ChunkedLocalAttentionManager
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec as VLLMSpec
    shape = {"block_size": block, "num_kv_heads": 2, "head_size": 16}
    ours = ChunkedLocalAttentionSpec(**shape, dtype_bytes=2, attention_chunk_size=chunk)
    theirs = VLLMSpec(**shape, dtype=torch.bfloat16, attention_chunk_size=chunk)
    assert ours.page_size_bytes == theirs.page_size_bytes
    for max_model_len, in_flight in [(256, 512), (4096, 2048), (32768, 8192), (100, 1)]:
        assert ours.blocks_per_request(max_model_len, in_flight) == \
            theirs.max_admission_blocks_per_request(in_flight, max_model_len)
    manager = SimpleNamespace(attention_chunk_size=chunk)
    assert ours.num_skipped_tokens(computed) == \
        ChunkedLocalAttentionManager.get_num_skipped_tokens(manager, computed)
    assert ours.tokens_read(computed + 1) == computed + 1 - ours.num_skipped_tokens(computed)


def test_tiny_llama4_groups_as_vllm_measured_them():
    """The issue's measurement (4 layers, chunk 32, NoPE every 4th, 64 MiB, block 32,
    max_model_len 256): 3 groups of one chunked layer + 1 full, 2,048 blocks, "16,384
    tokens, 64.00x"."""
    layout = KVCacheLayout.for_model(ModelConfig.load("tiny-llama4"), 32, "float32")
    assert [(g.layers, g.kind) for g in layout.groups] == [
        ((0,), CHUNKED), ((1,), CHUNKED), ((2,), CHUNKED), ((3,), FULL)]
    sized = kv_cache_config(layout, 64 * 2**20, 256, "CPU", 2048)
    assert sized.num_blocks == 2048
    assert sized.log_line().endswith("16,384 tokens, Maximum concurrency for 256 tokens per "
                                     "request: 64.00x")


def transformers_checkpoint(folder, **changes):
    """A float32 Llama4ForCausalLM as transformers makes and writes it, its weights spread."""
    from transformers import Llama4ForCausalLM, Llama4TextConfig
    hf = {**SMALL, **CASES[CASE], **changes}
    config = Llama4TextConfig(**{k: v for k, v in hf.items() if k != "model_type"})
    torch.manual_seed(0)
    Llama4ForCausalLM(config).to(torch.float32).save_pretrained(folder)
    spread(folder, gemma=False)
    return folder


def test_prefill_and_paged_decode_match_a_checkpoint_transformers_wrote(tmp_path):
    """transformers' own writing of Llama 4 (q and k in RoPE pairs, experts stacked [E, in,
    out]): the kit's prefill and every paged decode step within 1e-4 of the largest logit;
    prompts of 5, 30 and 37 tokens over chunks of 8, decode crossing chunk edges."""
    folder = transformers_checkpoint(tmp_path / "hf")
    got, expected = kit_and_reference_logits(folder, prompt_ids(CASE))
    assert relative_error(got, expected) <= kit.config.TOLERANCE["float32"]
    assert decode_error(folder, CASE, "eager") <= kit.config.TOLERANCE["float32"]


def test_each_llama4_part_moves_the_logits(tmp_path):
    """The parity is not blind to Llama 4's parts: without the chunks, the temperature
    tuning, the qk-norm, the shared expert, the input scaling or with the pairs of RoPE left
    unpermuted, the kit's logits leave the float32 tolerance by far."""
    folder = checkpoint(tmp_path, **CASES[CASE])
    spread(folder, gemma=False)
    ids = prompt_ids(CASE)
    got, expected = kit_and_reference_logits(folder, ids)
    assert relative_error(got, expected) <= kit.config.TOLERANCE["float32"]

    def unchunked(m):
        for layer in m.layers:
            layer.self_attn.chunk = None

    def halves_unpermuted(m):  # undo the load's permutation of q's and k's rows
        attn, d = m.layers[0].self_attn, m.arch.head_dim
        w = attn.qkv_proj.weight
        w.copy_(w.view(-1, 2, d // 2, w.shape[1]).transpose(1, 2).reshape(w.shape))
    changes = {"chunks": unchunked,
               "temperature": lambda m: setattr(m, "arch", dataclasses.replace(
                   m.arch, floor_scale=None)),
               "qk-norm": lambda m: setattr(m.layers[0].self_attn, "l2_norm_eps", None),
               "shared expert": lambda m: m.layers[1].mlp.shared_expert.down_proj.weight.zero_(),
               "input scaling": lambda m: setattr(m.layers[1].mlp.experts, "scale_input", False),
               "rope pairs": halves_unpermuted}
    for part, change in changes.items():
        model = kit_model(folder)
        with torch.no_grad():
            change(model)
            error = relative_error(model.compute_logits(model(ids)), expected)
        assert error > 1e-3, (part, error)


def test_scout_in_the_weights_split_and_the_calculator():
    """Chapter 01's split: 96.6 B of Scout's 107.8 B parameters are routed experts, 15.9%
    run per token. Chapter 02's calculator: its 201 GiB of bf16 weights fit no one common
    device; over 2 ranks an H200, over 4 an H100."""
    from kit.config import load
    from kit.studies.kv_cache_sizing import Calculator
    from kit.studies.memory_profiling import weights_split
    split = weights_split(ModelConfig.load("llama-4-scout"), "bfloat16")
    assert split["experts_bytes"] == 48 * 16 * 3 * 5120 * 8192 * 2
    assert (round(split["experts_share"], 3), round(split["active_share"], 3)) == (0.897, 0.159)
    compute = Calculator(load("cpu-small"), 10 * 2**20)
    knobs = dict(model="llama-4-scout", gpu_memory_utilization=0.9, block_size=16,
                 kv_cache_dtype="auto", max_model_len=1024)
    assert [compute.start_capacity({**knobs, "tensor_parallel_size": tp})
            for tp in (1, 2, 4)] == [None, 141 * 2**30, 80 * 2**30]


def vllm_admitted(folder, length: int, batched: int, block: int, budget: int) -> tuple:
    """(num_blocks, requests admitted) by vLLM's own `KVCacheManager` for `folder`'s model:
    requests of `length` tokens one after another, each admitted as the scheduler admits a
    waiting request (`full_sequence_must_fit`) and prefilled in steps of `batched` tokens."""
    from vllm import SamplingParams
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import (generate_scheduler_kv_cache_config,
                                             get_kv_cache_configs)
    from vllm.v1.request import Request
    from kit.vllm.kv_sizing import VLLMSizer, resolve_layout
    from kit.vllm.log import captured_vllm_log
    sizer = VLLMSizer.build(folder, block_size=block, max_model_len=length, dtype="float32")
    vc = sizer.vllm_config
    vc.scheduler_config.max_num_batched_tokens = batched
    with captured_vllm_log([]):
        resolve_layout(vc, sizer.specs)
        sched = generate_scheduler_kv_cache_config(get_kv_cache_configs(vc, [sizer.specs],
                                                                        [budget]))
    manager = KVCacheManager(sched, max_model_len=length, scheduler_block_size=block,
                             hash_block_size=block, max_in_flight_tokens=vc.max_in_flight_tokens,
                             enable_caching=False)
    admitted = 0
    while True:
        request = Request(str(admitted), prompt_token_ids=list(range(length)),
                          sampling_params=SamplingParams(max_tokens=1), pooling_params=None)
        for start in range(0, length, batched):
            if manager.allocate_slots(request, min(batched, length - start),
                                      full_sequence_must_fit=start == 0) is None:
                return sched.num_blocks, admitted
            request.num_computed_tokens = min(start + batched, length)
        admitted += 1


@pytest.mark.vllm
@pytest.mark.xdist_group("vllm_published")
@pytest.mark.parametrize("chunk,block,length,batched,budget", [
    (128, 32, 1024, 64, 64 << 20), (128, 32, 1024, 2048, 64 << 20),
    (128, 16, 2048, 100, 32 << 20), (32, 32, 1024, 64, 16 << 20)])
def test_the_block_manager_admits_what_vllms_admits(tmp_path, chunk, block, length, batched,
                                                     budget):
    """Chunks above the block (Llama-4-Scout: 8,192 above 16): vLLM's own KVCacheManager,
    admitting each request as its scheduler does and prefilling it in steps, against the kit's
    block manager on the kit's sizing of the same config: the same blocks, the same requests,
    and at least the ⌊max concurrency⌋ vLLM's start-up line promises (one fewer where the
    blocks divide evenly: the line counts the null block)."""
    from kit.studies.kv_cache_sizing import requests_that_fit
    hf = {**json.loads((kit.config.MODELS_DIR / "tiny-llama4.json").read_text()),
          "attention_chunk_size": chunk}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    blocks, admitted = vllm_admitted(tmp_path, length, batched, block, budget)
    layout = KVCacheLayout.for_model(ModelConfig.load(str(tmp_path / "config.json")), block,
                                     "float32")
    config = kv_cache_config(layout, budget, length, in_flight_tokens=batched)
    assert config.num_blocks == blocks
    null_short = config.num_blocks % config.blocks_per_request == 0  # the line counts block 0
    assert requests_that_fit(config) == admitted >= int(config.max_concurrency) - null_short
