"""Qwen3-Next and Qwen3.5 run by the kit's decoder (issue 35): on checkpoints transformers
wrote (`Qwen3NextConfig`, `Qwen3_5TextConfig`, tiny shapes, float32), the prefill and every
paged decode step (the gated delta-nets' states in their slots, the attention's keys and values
paged) against transformers' forward and the kit's own no-cache reference; what the decoder
does not build refused by name. (vLLM's Qwen3.5 module needs torchvision: no vLLM test.)"""
import json

import pytest
import torch

import kit
from kit.config import ModelConfig
from kit.config.settings import check_runnable
from kit.engine.no_cache import check_against_no_cache
from kit.errors import ConfigError
from tests.test_checkpoint import (edit_tensors, kit_and_reference_logits, kit_model,
                                   kit_paged_decode, paged_error, reference_model, relative_error)

FAMILIES = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")
QWEN3_NEXT_EXPERTS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
                      "shared_expert_intermediate_size", "mlp_only_layers")
# 3 gated delta-nets and 1 attention layer; 2 key heads serving 4 value heads; experts on 3
# layers (layer 1 dense: mlp_only_layers), a quarter of each attention head turned by RoPE
TINY = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
        "linear_value_head_dim": 12, "num_experts": 8, "num_experts_per_tok": 2,
        "moe_intermediate_size": 24, "shared_expert_intermediate_size": 32,
        "mlp_only_layers": [1], "max_position_embeddings": 256}
# Qwen3.5's text model: the same layers, dense MLPs, the delta-net's projections stored apart,
# a float32 state, and multimodal RoPE's split over half of each head (plain RoPE on text)
TINY_3_5 = {**{k: v for k, v in TINY.items() if k not in QWEN3_NEXT_EXPERTS},
            "mamba_ssm_dtype": "float32",
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                "partial_rotary_factor": 0.5, "mrope_section": [2, 1, 1],
                                "mrope_interleaved": True}}
# Qwen3.5's MoE sizes: Qwen3.5's layers with Qwen3-Next's experts and gated shared expert on
# every layer
TINY_3_5_MOE = {**TINY_3_5, **{k: TINY[k] for k in QWEN3_NEXT_EXPERTS[:-1]}}


def spread_qwen3_next(folder, seed=0):
    """Weights far from the writer's defaults, so that every tensor moves the logits: the
    zero-centred norms away from 0, the delta-net's gated norm away from 1, decays and
    convolution taps of order one, attention scores well above 1."""
    gen = torch.Generator().manual_seed(seed)

    def change(tensors):
        for name, t in tensors.items():
            noise = torch.randn(t.shape, generator=gen)
            if name.endswith("linear_attn.norm.weight"):
                tensors[name] = 1.0 + 0.3 * noise
            elif name.endswith("norm.weight"):
                tensors[name] = 0.3 * noise
            elif name.endswith(("A_log", "dt_bias")) or "embed" in name:
                tensors[name] = noise
            else:
                gain = 3.0 if name.endswith(("q_proj.weight", "k_proj.weight")) else 1.0
                tensors[name] = gain * noise / t.shape[-1] ** 0.5
    edit_tensors(folder, change)


def transformers_checkpoint(tmp_path, spread_weights: bool = True, family: str = "qwen3_next",
                            **changes):
    transformers = pytest.importorskip("transformers")
    config_class, tiny = {"qwen3_next": (transformers.Qwen3NextConfig, TINY),
                          "qwen3_5_text": (transformers.Qwen3_5TextConfig, TINY_3_5),
                          "qwen3_5_moe_text": (transformers.Qwen3_5MoeTextConfig,
                                               TINY_3_5_MOE)}[family]
    config = config_class(**{**tiny, **changes})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    folder = tmp_path / family
    model.save_pretrained(folder)
    if spread_weights:
        spread_qwen3_next(folder)
    return folder


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_logits_match_transformers(tmp_path, family):
    """3 prompts of 70 tokens (a chunk of 64 and a padded one)."""
    folder = transformers_checkpoint(tmp_path, family=family)
    ids = torch.randint(0, 512, (3, 70), generator=torch.Generator().manual_seed(1))
    got, expected = kit_and_reference_logits(folder, ids)
    error = relative_error(got, expected)
    print(f"{family}: prefill max |kit - transformers| / max |logit| = {error:.2e}")
    assert error <= kit.config.TOLERANCE["float32"]


@pytest.mark.parametrize("family,strategy", [
    ("qwen3_next", "eager"), ("qwen3_5_text", "eager"), ("qwen3_5_moe_text", "eager"),
    pytest.param("qwen3_next", "guard_free", marks=pytest.mark.slow)])  # (compiles)
def test_every_paged_decode_step_matches_transformers_and_the_no_cache_reference(
        tmp_path, family, strategy):
    """Prompts of 5, 8 and 11 tokens, 6 greedy steps (the attention's blocks raised to 32 by
    the hybrid's page rule): every step's logits (the prefill's included) within float32's
    1e-4 of transformers' forward over the prompt and the tokens fed back, and of the kit's
    own `no_cache_logits` (each delta-net's states from the slot its group's block holds)."""
    folder = transformers_checkpoint(tmp_path, family=family)
    reference = reference_model(folder, torch.float32)
    prompts, run = kit_paged_decode(folder, [5, 8, 11], 6, strategy)
    worst = paged_error(reference, prompts, run, 6)
    print(f"{family} {strategy}: paged decode, 6 steps, max |kit - transformers| / "
          f"max |logit| = {worst:.2e}")
    assert worst <= kit.config.TOLERANCE["float32"]
    own = check_against_no_cache(kit_model(folder), prompts, run, "float32")
    print(f"{family} {strategy}: against no_cache_logits {own.max_error:.2e}")
    assert own.ok and own.token_agreement == 1.0


def test_bfloat16_paged_decode_within_the_kits_tolerance(tmp_path):
    """In bfloat16 (vLLM's CPU engine runs a gated delta-net in bf16 only), on the weights as
    written: every step within the kit's bf16 tolerance of transformers in bf16 and of the
    kit's no-cache reference, every greedy token the reference's."""
    folder = transformers_checkpoint(tmp_path, spread_weights=False)
    prompts, run = kit_paged_decode(folder, [5, 8, 11], 6, "eager", "bfloat16")
    reference = reference_model(folder, torch.bfloat16)
    worst = paged_error(reference, prompts, run, 6)
    own = check_against_no_cache(kit_model(folder, "bfloat16"), prompts, run, "bfloat16")
    print(f"qwen3_next bf16: against transformers {worst:.2e}, no_cache_logits "
          f"{own.max_error:.2e}")
    assert worst <= kit.config.TOLERANCE["bfloat16"]
    assert own.ok and own.token_agreement == 1.0


@pytest.mark.parametrize("changes,message", [
    ({"attention_bias": True}, "attention_bias=True"),
    ({"tie_word_embeddings": True}, "tie_word_embeddings=True"),
    ({"attn_output_gate": False}, "attn_output_gate=False"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"mamba_ssm_dtype": "float32"}, r"does not build: \['mamba_ssm_dtype'\]"),
    ({"linear_num_value_heads": 3}, "not a multiple of linear_num_key_heads 2"),
])
def test_what_the_decoder_does_not_build_is_refused_by_name(changes, message):
    arch = ModelConfig.from_dict({"model_type": "qwen3_next", **TINY, **changes}, "tiny")
    with pytest.raises(ConfigError, match=message):
        check_runnable(arch)


@pytest.mark.parametrize("changes,message", [
    ({"num_experts": 8}, r"does not build: \['num_experts'\]"),
    ({"layer_scale": True}, "layer_scale=True"),
    ({"output_gate_type": "sigmoid"}, "output_gate_type='sigmoid'"),
    ({"mamba_ssm_dtype": "float8"}, "mamba_ssm_dtype='float8'"),
    ({"attn_output_gate": False}, "Qwen3.5 decoder does not build attn_output_gate=False"),
])
def test_what_the_qwen3_5_decoder_does_not_build_is_refused_by_name(changes, message):
    arch = ModelConfig.from_dict({"model_type": "qwen3_5_text", **TINY_3_5, **changes}, "tiny")
    with pytest.raises(ConfigError, match=message):
        check_runnable(arch)


@pytest.mark.parametrize("changes,message", [
    ({"decoder_sparse_step": 2}, "decoder_sparse_step=2"),
    ({"mlp_only_layers": [1]}, r"mlp_only_layers=\[1\]"),
    ({"norm_topk_prob": False}, "norm_topk_prob=False"),
    ({"intermediate_size": 96, "use_sliding_window": True}, "use_sliding_window=True"),
])
def test_what_the_qwen3_5_moe_decoder_does_not_build_is_refused_by_name(changes, message):
    """transformers and vLLM put experts on every layer whatever decoder_sparse_step and
    mlp_only_layers say, and renormalise the picked probabilities: other values refused."""
    arch = ModelConfig.from_dict({"model_type": "qwen3_5_moe_text", **TINY_3_5_MOE, **changes},
                                 "tiny")
    with pytest.raises(ConfigError, match="Qwen3.5 MoE decoder does not build .*" + message):
        check_runnable(arch)


def test_qwen3_5_35b_a3b_is_accepted_with_experts_on_every_layer():
    arch = ModelConfig.load("qwen3.5-35b-a3b")
    check_runnable(arch)
    assert set(arch.mlp_kinds) == {"experts"} and arch.norm_topk_prob
    assert (arch.num_experts, arch.num_experts_per_tok) == (256, 8)
    assert arch.parts.shared_expert_gate and arch.recurrent.ssm_dtype == "float32"


def test_qwen3_5_27b_is_accepted_with_its_state_dtype_and_rope():
    """Its tied-or-not head, mamba_ssm_dtype and multimodal RoPE's split all read."""
    arch = ModelConfig.load("qwen3.5-27b")
    check_runnable(arch)
    assert (arch.rope_theta, arch.partial_rotary_factor) == (10_000_000, 0.25)
    assert arch.recurrent.ssm_dtype == "float32" and arch.num_experts in (0, None)
    tied = ModelConfig.from_dict({**json.loads(arch.source_config), "tie_word_embeddings": True},
                                 "tied")
    check_runnable(tied)
    assert tied.tie_word_embeddings


def test_the_published_shape_is_accepted_and_reads_its_rope():
    arch = ModelConfig.load("qwen3-next-80b-a3b")
    check_runnable(arch)
    assert (arch.rope_theta, arch.partial_rotary_factor) == (10_000_000, 0.25)
    assert arch.layer_types.count("full_attention") == 12


def test_compiled_bfloat16_decode_is_checked_against_its_own_routing():
    """A compiled bf16 step rounds otherwise than an eager one, so an eager rerun may route a
    near-tie otherwise and then follow hidden states the run never had (tiny-gdn's chapter 04:
    1.3e-1). The check records the run's routing through its own compiled step (kit::noted runs
    inside compiled code): exactly the picks the run made, and its logits within bf16's
    tolerance of the no-cache reference routed so."""
    from kit.engine.decode import batch_for_run, generate, make_prompts
    from kit.engine.decode_runners import decode_runner
    from kit.engine.kv_cache import KVCacheLayout
    from kit.engine.layers.experts import noting_picks
    from kit.engine.model import build_model
    from kit.engine.routing_replay import check_routed_against_no_cache, record_routing
    arch = ModelConfig.from_dict({"model_type": "qwen3_next", "rms_norm_eps": 1e-6, **TINY,
                                  "num_hidden_layers": 2, "full_attention_interval": 2,
                                  "mlp_only_layers": []}, "tiny-qwen3-next")  # (compiles less)
    model = build_model(arch, "bfloat16", "cpu", seed=0)
    lengths = [5, 8, 11]
    prompts = make_prompts(lengths, arch.vocab_size, 3)
    batch = batch_for_run(KVCacheLayout.for_model(arch, 4, "bfloat16"), lengths, 6, "cpu")
    runner = decode_runner(model, batch, prompts, "guard_free")
    with noting_picks() as noted:
        run = generate(model, batch, prompts, 6, step=runner)
    recorded = record_routing(model, batch, prompts, run, step=runner)
    layers = sorted({layer for layer, _ in noted})  # per MoE layer, the run's 6 steps' picks
    picked = [[ids for layer, ids in noted if layer == j][-6:] for j in layers]
    assert all(torch.equal(recorded[i][j][-6:], torch.cat([ids[i:i + 1] for ids in picked[j]]))
               for i in range(len(prompts)) for j in range(len(layers)))
    check = check_routed_against_no_cache(model, batch, prompts, run, "bfloat16", step=runner)
    runner.discard()
    print(f"compiled bf16: {check.max_error:.2e}, {check.routing.summary()}")
    assert check.ok, (check.max_error, check.routing.summary())
