"""The parameter counts of the families the kit sizes but does not run (latent attention, Mamba-2
and gated delta-net hybrids: kit/config/cache_kinds_counts.py) against the models transformers
builds from the same config on the meta device (no memory), and what the weights budget and the
calculator make of them."""
import json

import pytest
import torch
import transformers as T
from transformers import AutoConfig, AutoModelForCausalLM

from kit.config import MODELS_DIR, ModelConfig, load
from kit.config.cache_kinds import LATENT_FAMILIES, STATE_FAMILIES
from kit.engine.budget import estimate_activation_bytes, mlp_live_elements, weights_budget
from kit.studies.kv_cache_sizing import calculate

GiB = 2**30
SMALL = dict(hidden_size=64, intermediate_size=96, vocab_size=100, num_attention_heads=4)
LATENT = dict(kv_lora_rank=48, qk_rope_head_dim=16, qk_nope_head_dim=24, v_head_dim=20,
              moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
              first_k_dense_replace=1, num_hidden_layers=3, num_key_value_heads=4)
DELTA = dict(num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
             linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=24)
# Each family at tiny shapes, with what sets its count apart: a low-rank query and two shared
# experts (DeepSeek-V2), the routing-score bias vLLM keeps (V3's noaux_tc), Mamba-2 groups,
# biases and a tied head (Granite), Granite without experts, Nemotron-H's MLP-only and
# non-gated MoE layers, Qwen3-Next's dense layer and gated shared expert, Qwen3.5 dense and
# Qwen3.5's MoE (experts on every layer).
TINY = {
    "deepseek_v2": lambda: T.DeepseekV2Config(**SMALL, **LATENT, q_lora_rank=40,
                                              n_shared_experts=2),
    "deepseek_v3": lambda: T.DeepseekV3Config(**SMALL, **LATENT, q_lora_rank=None,
                                              n_shared_experts=1, topk_method="noaux_tc"),
    "granitemoehybrid": lambda: T.GraniteMoeHybridConfig(
        **SMALL, num_hidden_layers=2, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, shared_intermediate_size=48, mamba_n_heads=8, mamba_d_head=16,
        mamba_d_state=16, mamba_n_groups=2, mamba_proj_bias=True, attention_bias=True,
        tie_word_embeddings=True, layer_types=["mamba", "attention"]),
    "granite_dense": lambda: T.GraniteMoeHybridConfig(
        **SMALL, num_hidden_layers=2, num_key_value_heads=2, num_local_experts=0,
        shared_intermediate_size=80, mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16,
        layer_types=["mamba", "attention"]),
    "nemotron_h": lambda: T.NemotronHConfig(
        **SMALL, num_hidden_layers=4, num_key_value_heads=2, head_dim=16, mamba_num_heads=8,
        mamba_head_dim=16, ssm_state_size=16, n_groups=2, hybrid_override_pattern="M-*E",
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=48),
    "qwen3_next": lambda: T.Qwen3NextConfig(
        **SMALL, **DELTA, num_hidden_layers=3, full_attention_interval=3, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        mlp_only_layers=[1]),
    "qwen3_5_text": lambda: T.Qwen3_5TextConfig(**SMALL, **DELTA, num_hidden_layers=2,
                                                full_attention_interval=2),
    "qwen3_5_moe_text": lambda: T.Qwen3_5MoeTextConfig(
        **SMALL, **DELTA, num_hidden_layers=2, full_attention_interval=2, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48),
}
SIZED_FAMILIES = LATENT_FAMILIES + STATE_FAMILIES
PUBLISHED = sorted(p.stem for p in MODELS_DIR.glob("*.json")
                   if json.loads(p.read_text()).get("model_type") in SIZED_FAMILIES)


def transformers_count(config, hf: dict) -> int:
    """Parameters of transformers' model for `config` built on the meta device, with the
    routing-score biases vLLM keeps as parameters where transformers keeps buffers
    (`e_score_correction_bias`: vLLM's DeepseekV2MoE with topk_method "noaux_tc", every
    NemotronHMoE), so that the count is what vLLM loads (the vocabulary unpadded)."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    vllm_keeps = hf["model_type"] == "nemotron_h" or hf.get("topk_method") == "noaux_tc"
    biases = sum(b.numel() for n, b in model.named_buffers()
                 if n.endswith("e_score_correction_bias")) if vllm_keeps else 0
    return sum(p.numel() for p in model.parameters()) + biases


def tiny(name: str) -> tuple:
    config = TINY[name]()
    return config, ModelConfig.from_dict(config.to_dict(), name)


@pytest.mark.parametrize("name", sorted(TINY))
def test_tiny_counts_equal_transformers(name):
    """Every sized-only family's count equals the model transformers builds from the same
    config (what vLLM builds too: checked against vLLM's own meta build for these shapes)."""
    config, arch = tiny(name)
    assert arch.parts.sized_only
    assert arch.num_parameters() == transformers_count(config, config.to_dict())


@pytest.mark.parametrize("name", PUBLISHED)
def test_published_counts_equal_transformers(name):
    """The published shapes in data/models/ (DeepSeek-V3's 671,026,419,200 among them)."""
    hf = json.loads((MODELS_DIR / f"{name}.json").read_text())
    config = AutoConfig.for_model(**hf)
    assert ModelConfig.load(name).num_parameters() == transformers_count(config, hf)


def test_active_parameters_by_hand():
    """A token runs k of E experts: Qwen3-Next's two MoE layers leave (4 - 2) experts of 3
    gated matrices 64 × 32 unread, Nemotron-H's one MoE layer (4 - 2) experts of 2 (up and
    down, relu² needs no gate)."""
    _, qwen = tiny("qwen3_next")
    assert qwen.num_parameters() - qwen.active_parameters() == 2 * (4 - 2) * 3 * 64 * 32
    assert qwen.experts_parameters() == 2 * 4 * 3 * 64 * 32
    _, nemotron = tiny("nemotron_h")
    assert nemotron.num_parameters() - nemotron.active_parameters() == (4 - 2) * 2 * 64 * 32
    _, dense = tiny("qwen3_5_text")
    assert dense.active_parameters() == dense.num_parameters() and not dense.experts_parameters()


def test_mlp_live_elements_per_layer_kind():
    """Nemotron-H's layers: a Mamba-2 layer and an attention layer hold no MLP, its MLP layer
    the up output and its relu² (2 × 96), its MoE layer 2 routed rows of (max(32, 64) + 32)
    or the shared expert's 2 × 48."""
    _, arch = tiny("nemotron_h")
    assert [mlp_live_elements(arch, i) for i in range(4)] == [0, 2 * 96, 0, 2 * (64 + 32)]


@pytest.mark.parametrize("name", sorted(TINY))
def test_weights_budget_and_activations(name):
    """The budget charges every parameter in the model dtype, split over the ranks; the
    activation estimate is positive and grows with the batch."""
    _, arch = tiny(name)
    budget = weights_budget(arch, "bfloat16", GiB, 0.9, tensor_parallel_size=2)
    assert budget.weights_bytes == arch.num_parameters() * 2 // 2
    small, large = (estimate_activation_bytes(arch, n, 4, 2) for n in (16, 256))
    assert 0 < small < large


def test_calculator_takes_a_sized_only_model(tmp_path):
    """The calculator on a sized-only config.json: weights counted as above, activations
    estimated, the rest left to the KV cache."""
    config, arch = tiny("qwen3_next")
    config.save_pretrained(tmp_path)
    calc = calculate(load("cpu-small"), 10**6, str(tmp_path / "config.json"),
                     capacity_bytes=GiB, gpu_memory_utilization=0.9, block_size=16,
                     kv_cache_dtype="auto", max_model_len=256)
    assert calc.activations == "estimated"
    assert calc.budget.weights_bytes == arch.num_parameters() * load("cpu-small").dtype_bytes
    assert calc.budget.kv_cache_bytes > 0
