"""Mixtures of experts in the budget (issue 34): every expert resident in the weights, an MoE
layer's routed rows in the activation estimate, the published shapes' counts, chapter 02's
calculator and the model table on Qwen3-30B-A3B and Mixtral-8x7B. Arithmetic and meta-device
builds only: no weights allocated."""
import pytest

from kit.config import ModelConfig, load
from kit.engine.budget import (estimate_activation_bytes, mlp_floor_bytes, mlp_live_elements,
                               weights_budget)
from kit.units import GiB

# The published checkpoints' parameter counts (every expert) and those one token runs
# (its k experts, attention, routers, norms and both embeddings).
COUNTS = {"qwen3-30b-a3b": (30_532_122_624, 3_353_032_704),
          "mixtral-8x7b": (46_702_792_704, 12_879_925_248),
          # the text decoder of Llama 4 Scout (transformers' Llama4ForCausalLM counts the same;
          # the published 109 B adds the vision encoder), a shared expert per layer
          "llama-4-scout": (107_769_861_120, 17_172_894_720)}


@pytest.mark.parametrize("name", COUNTS)
def test_the_published_moe_shapes_count_every_expert_and_the_active_ones(name):
    arch = ModelConfig.load(name)
    assert (arch.num_parameters(), arch.active_parameters()) == COUNTS[name]
    e, k = arch.num_experts, arch.num_experts_per_tok
    assert arch.num_parameters() - arch.active_parameters() == \
        arch.num_hidden_layers * (e - k) * arch.expert_weights()


def test_gpt_oss_experts_count_their_biases_where_unpicked_and_resident():
    """gpt-oss's experts carry biases (2·I + H each): an unpicked expert leaves them unread too,
    and the experts' share counts them, as the experts built on the meta device hold them."""
    from kit.measure.roofline import unread_expert_weights
    from kit.studies.memory_profiling import built_experts_parameters
    arch = ModelConfig.load("gpt-oss-20b")
    e, k, i, h = (arch.num_experts, arch.num_experts_per_tok, arch.moe_intermediate_size,
                  arch.hidden_size)
    assert arch.expert_elements() == 3 * h * i + 2 * i + h
    assert arch.num_parameters() - arch.active_parameters() == \
        arch.num_hidden_layers * (e - k) * arch.expert_elements()
    assert unread_expert_weights(arch, [k] * arch.num_hidden_layers) == \
        arch.num_parameters() - arch.active_parameters()
    assert built_experts_parameters(arch) == arch.experts_parameters()


def test_the_experts_built_on_the_meta_device_are_the_counted_ones():
    from kit.studies.memory_profiling import built_experts_parameters
    for name in ("qwen3-30b-a3b", "tiny-moe"):
        arch = ModelConfig.load(name)
        assert built_experts_parameters(arch) == arch.experts_parameters() > 0


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_the_budget_keeps_every_expert_resident_split_over_the_ranks(tp):
    """Weights are every expert's, not the k a token runs: Qwen3-30B-A3B's 57 GiB in bf16, of
    which 95% experts, divided over the tensor-parallel ranks."""
    arch = ModelConfig.load("qwen3-30b-a3b")
    budget = weights_budget(arch, "bfloat16", 80 * GiB, 0.9, tp)
    assert budget.weights_bytes == 30_532_122_624 * 2 // tp
    assert budget.weights_bytes > 8 * arch.active_parameters() * 2 // tp
    assert round(arch.experts_parameters() / arch.num_parameters(), 3) == 0.950


def test_an_moe_layers_routed_rows_in_the_activation_estimate():
    """Per token: the dense MLP's 3 × I, an MoE layer's k × (max(2I, H) + I) as vLLM's fused
    experts hold them; tiny-moe's active MLP is tiny's, so both estimate alike."""
    qwen, mixtral = ModelConfig.load("qwen3-30b-a3b"), ModelConfig.load("mixtral-8x7b")
    assert mlp_live_elements(qwen, 0) == 8 * (2048 + 768)
    assert mlp_live_elements(mixtral, 0) == 2 * (2 * 14336 + 14336)
    tiny, moe = ModelConfig.load("tiny"), ModelConfig.load("tiny-moe")
    assert mlp_live_elements(moe, 0) == mlp_live_elements(tiny, 0) == 3 * 1024
    assert estimate_activation_bytes(qwen, 2048, 8, 2) == \
        2048 * (2 * 2048 + 8 * (2048 + 768)) * 2 + 8 * 151_936 * 6
    assert mlp_floor_bytes(moe, 2048, 2) == 2048 * 4 * 2 * 256 * 2
    assert mlp_floor_bytes(tiny, 2048, 2) == 2048 * 1024 * 2


def test_a_layer_left_dense_among_moe_layers_counts_its_own_mlp():
    arch = ModelConfig.from_dict({**ModelConfig.load("tiny-moe").hf_dict(),
                                  "intermediate_size": 4096, "mlp_only_layers": [1]}, "mixed")
    assert arch.mlp_kinds == ("experts", "dense", "experts", "experts")
    assert mlp_live_elements(arch, 1) == 3 * 4096 > mlp_live_elements(arch, 0)
    assert estimate_activation_bytes(arch, 100, 1, 2) == \
        100 * (2 * 256 + 3 * 4096) * 2 + 32000 * 6


@pytest.mark.parametrize("name,gib", [("qwen3-30b-a3b", 80), ("mixtral-8x7b", 141)])
def test_the_calculator_serves_the_moe_models_with_every_expert_resident(name, gib):
    """Chosen in chapter 02's calculator: the weights of every expert, and the smallest common
    GPU memory that holds them and one request (Mixtral's 87 GiB need an H200)."""
    from kit.studies.kv_cache_sizing import Calculator
    s = load("cpu-small")
    compute = Calculator(s, 10 * 2**20)
    knobs = dict(model=name, gpu_memory_utilization=0.9, block_size=16, kv_cache_dtype="auto",
                 max_model_len=1024)
    assert compute.start_capacity(knobs) == gib * GiB
    calc = compute(**knobs, capacity_bytes=gib * GiB)
    arch = ModelConfig.load(name)
    assert calc.budget.weights_bytes == arch.num_parameters() * 2
    assert calc.activations == "estimated" and calc.fit_advice() is None
    assert calc.budget.activation_bytes == estimate_activation_bytes(arch, 2048, 8, 2)
    assert calc.config.num_blocks > 0


def test_the_calculator_widget_moves_to_an_h100_then_an_h200():
    from kit.show.widgets import kv_calculator
    from kit.studies.kv_cache_sizing import Calculator
    s = load("cpu-small")
    box = kv_calculator(s, 96 * 2**20, Calculator(s, 10 * 2**20), {"as configured": 0}).box
    model, memory, numbers = box.children[0], box.children[2], box.children[-2]
    model.value = "qwen3-30b-a3b"
    assert memory.value == 80 * GiB and "device_memory moved to 80 GiB" in numbers.value
    model.value = "mixtral-8x7b"  # its 87 GiB of weights do not fit 80 GiB × 0.9
    assert memory.value == 141 * GiB and "device_memory moved to 141 GiB" in numbers.value
    assert "Does not fit" not in numbers.value and "KV cache size" in numbers.value


def test_the_model_table_shows_total_and_active_parameters():
    from kit.show.tables import model_table, parameters_cell
    assert parameters_cell(ModelConfig.load("qwen3-30b-a3b")) == \
        "30,532,122,624 (3,353,032,704 active: 8 of 128 experts)"
    assert parameters_cell(ModelConfig.load("tiny")) == "20,318,464"
    row = model_table(load("cpu-small", model="tiny-moe")).rows[0]
    assert row["parameters"].endswith("active: 4 of 16 experts)")


def test_chapter_01s_weights_split_and_one_layer():
    from kit.studies.memory_profiling import one_layer, weights_split
    mixtral = weights_split(ModelConfig.load("mixtral-8x7b"), "bfloat16")
    assert mixtral["weights_bytes"] == 46_702_792_704 * 2
    assert mixtral["experts_bytes"] == 32 * 8 * 3 * 4096 * 14336 * 2
    assert round(mixtral["experts_share"], 3) == 0.966 and round(mixtral["active_share"], 3) == 0.276
    assert weights_split(ModelConfig.load("tiny"), "bfloat16")["experts_bytes"] == 0
    layer = one_layer(ModelConfig.load("tiny-moe"))
    assert (layer.num_hidden_layers, layer.mlp_kinds) == (1, ("experts",))
    assert layer.num_parameters() == ModelConfig.load("tiny-moe").num_parameters() \
        - 3 * layer.layer_weights(0) - 3 * 2 * 256 - 3 * 2 * 32


def test_the_experts_pair_profiles_under_a_preset_longer_than_tiny(monkeypatch):
    """The gpu preset's max_model_len (8,192) is beyond tiny's 2,048: the pair's settings are
    cut to it (a profile does not read it) rather than refused."""
    from kit.studies import memory_profiling
    seen = []
    monkeypatch.setattr(memory_profiling, "profile_memory",
                        lambda s, arch: seen.append((s.model, s.max_model_len, arch)))
    memory_profiling.experts_profiles(load("gpu", device="cpu"))
    assert [(m, n, a.num_hidden_layers) for m, n, a in seen] == [("tiny-moe", 2048, 1),
                                                                   ("tiny", 2048, 1)]
