"""DeepSeek-V3 run by the kit (issue 35): its router (sigmoid scores, a learned per-expert bias
`e_score_correction_bias` used for choosing only, groups scored by the sum of their 2 best
biased scores, weights the unbiased scores renormalised and times routed_scaling_factor) on
checkpoints transformers wrote (`DeepseekV3Config`, tiny shapes, float32), the prefill and
every paged decode step against transformers' forward and the kit's own no-cache reference;
the bias and the groups each shown to matter."""
import dataclasses

import pytest
import torch

import kit
from kit.config import ModelConfig
from kit.config.settings import check_runnable
from kit.engine.layers.mla_moe import DeepSeekMoE
from kit.engine.model import build_model
from kit.engine.no_cache import check_against_no_cache
from tests.test_checkpoint import (edit_tensors, kit_model, kit_paged_decode, paged_error,
                                   reference_model, relative_error, spread)
from tests.test_mla import TINY

# noaux_tc as real DeepSeek-V3 configs name it (transformers' class writes both keys when
# given them; vLLM needs them), 8 experts in 2 groups of 4, experts from the best group only,
# routed_scaling_factor 2.5 (V3's); then the query's low-rank pair, 3 experts from the best 2
# of 4 groups and YaRN with DeepSeek's mscale (V3's published rope_scaling, scaled down)
V3 = {"topk_method": "noaux_tc", "scoring_func": "sigmoid", "n_group": 2, "topk_group": 1,
      "routed_scaling_factor": 2.5, "norm_topk_prob": True, "num_key_value_heads": 4}
CASES = {
    "v3-groups": {},
    "v3-qlora-yarn": {
        "q_lora_rank": 24, "n_group": 4, "topk_group": 2, "num_experts_per_tok": 3,
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                            "original_max_position_embeddings": 64, "mscale": 1.0,
                            "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}},
}
BIAS = "e_score_correction_bias"


def spread_bias(folder, scale: float = 0.2, seed: int = 1):
    """Each MoE layer's routing bias drawn at `scale` (sigmoid scores here spread by about as
    much), so that the bias changes which experts a token picks but does not decide alone."""
    gen = torch.Generator().manual_seed(seed)

    def change(tensors):
        for name in tensors:
            if name.endswith(BIAS):
                tensors[name] = scale * torch.randn(tensors[name].shape, generator=gen)
    edit_tensors(folder, change)


def v3_checkpoint(tmp_path, case: str):
    """A folder transformers wrote (`DeepseekV3Config`, `from_config`, `save_pretrained`), its
    weights spread so that every tensor moves the logits, the routing bias spread
    (`spread_bias`)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.DeepseekV3Config(**{**TINY, **V3, **CASES[case]})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    folder = tmp_path / case
    model.save_pretrained(folder)
    spread(folder, gemma=False)
    spread_bias(folder)
    return folder


def prefill_error(folder, arch=None) -> float:
    """The kit's prefill of 3 prompts of 11 tokens against transformers', relative to the
    largest logit (`arch`: the config as the kit reads it, or changed)."""
    ids = torch.randint(0, 1000, (3, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference_model(folder, torch.float32)(input_ids=ids).logits
        model = build_model(arch or ModelConfig.load(str(folder)), "float32", "cpu")
        return relative_error(model.compute_logits(model(ids)), expected)


@pytest.mark.parametrize("case", CASES)
def test_prefill_logits_match_transformers(tmp_path, case):
    folder = v3_checkpoint(tmp_path, case)
    check_runnable(ModelConfig.load(str(folder)))  # what transformers wrote is all honoured
    error = prefill_error(folder)
    print(f"{case}: prefill max |kit - transformers| / max |logit| = {error:.2e}")
    assert error <= kit.config.TOLERANCE["float32"]


@pytest.mark.parametrize("case", CASES)
def test_every_paged_decode_step_matches_transformers_and_the_no_cache_reference(tmp_path,
                                                                                 case):
    """Prompts of 5, 8 and 11 tokens, 6 greedy steps, blocks of 4: every step's logits within
    float32's 1e-4 of transformers' forward over the prompt and the tokens fed back, and of
    the kit's own `no_cache_logits`."""
    folder = v3_checkpoint(tmp_path, case)
    reference = reference_model(folder, torch.float32)
    prompts, run = kit_paged_decode(folder, [5, 8, 11], 6, "eager")
    worst = paged_error(reference, prompts, run, 6)
    print(f"{case}: paged decode, 6 steps, max |kit - transformers| / max |logit| = "
          f"{worst:.2e}")
    assert worst <= kit.config.TOLERANCE["float32"]
    own = check_against_no_cache(kit_model(folder), prompts, run, "float32")
    print(f"{case}: against no_cache_logits {own.max_error:.2e}")
    assert own.ok and own.token_agreement == 1.0


@pytest.mark.parametrize("part", ["bias", "groups", "top2", "scoring_func",
                                  "routed_scaling_factor"])
def test_each_part_of_the_router_moves_the_logits(tmp_path, part, monkeypatch):
    """The parity above is no accident: without the bias, without the groups (every expert
    eligible), with groups scored by their best expert (V2's rule) instead of their best two,
    with V2's softmax, or unscaled, the kit's prefill is far from transformers'."""
    folder = v3_checkpoint(tmp_path, "v3-groups")
    arch = ModelConfig.load(str(folder))
    routing = {"groups": {"n_group": 1, "topk_group": 1}, "scoring_func": {
        "scoring_func": "softmax"}, "routed_scaling_factor": {"routed_scaling_factor": 1.0}}
    if part == "bias":
        arch = dataclasses.replace(arch, router_score_bias=False)
    elif part == "top2":
        from kit.engine.layers import mla_moe
        plain = mla_moe.group_limited
        monkeypatch.setattr(mla_moe, "group_limited", lambda s, n, k, top2: plain(s, n, k))
    else:
        arch = dataclasses.replace(arch, deepseek=dataclasses.replace(arch.deepseek,
                                                                      **routing[part]))
    if part == "bias":  # the checkpoint's bias tensors are then left unread
        from kit.engine import checkpoint
        monkeypatch.setattr(checkpoint, "check_tensors", lambda arch, where: None)
    error = prefill_error(folder, arch)
    print(f"without {part}: {error:.2e}")
    assert error > 100 * kit.config.TOLERANCE["float32"]


def test_the_bias_chooses_but_does_not_weigh():
    """One token, 4 experts in 2 groups, k = 2: the bias lifts experts 2 and 3 above 0 and 1
    (their group wins), yet the weights are their unbiased sigmoids, renormalised, × 2.5."""
    arch = ModelConfig.from_dict({"model_type": "deepseek_v3", **TINY, **V3,
                                  "n_routed_experts": 4}, "tiny")
    with torch.device("meta"):
        moe = DeepSeekMoE(arch, 1)
    moe.e_score_correction_bias = torch.nn.Parameter(torch.tensor([0.0, 0.0, 1.0, 1.0]))
    logits = torch.tensor([[2.0, 1.0, -1.0, -2.0]])
    weights, ids = moe.picks(logits)
    assert sorted(ids[0].tolist()) == [2, 3]
    chosen = torch.tensor([-1.0, -2.0]).sigmoid()
    expected = 2.5 * chosen / chosen.sum()
    assert torch.allclose(weights[0].sort().values, expected.sort().values)


@pytest.mark.vllm
def test_vllms_cpu_rope_kernel_turns_the_wrong_elements_of_a_latent_query():
    """Why vLLM 0.32's CPU engine parts from transformers (and the kit) on DeepSeek: its MLA
    rotates `q[..., qk_nope_head_dim:]` ([tokens, heads, rope], a strided view) and
    `k_pe.unsqueeze(1)` in place through `RotaryEmbedding.forward_cpu`, whose kernel
    (`torch.ops._C.rotary_embedding`, csrc/cpu/pos_encoding.cpp) takes size(-1) / head_size = 1
    head per token and stride(-2), the head stride, as the token stride. On a [tokens,
    heads × rope] tensor it rotates as transformers does. (Fails once vLLM fixes the kernel.)"""
    pytest.importorskip("vllm")
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope
    from kit.engine.layers.rotary import apply_rope_pairs, rope_cos_sin
    with set_current_vllm_config(VllmConfig()):
        rope = get_rope(64, 256, is_neox_style=False, dtype=torch.float32,
                        rope_parameters={"rope_theta": 10000.0, "rope_type": "default"})
    tokens, positions = 11, torch.arange(11)
    q = torch.randn(tokens, 4, 96, generator=torch.Generator().manual_seed(0))
    cos, sin = rope_cos_sin(positions, 64, 10000.0, ())
    expected = apply_rope_pairs(q[..., 32:], cos, sin)
    flat = q[..., 32:].reshape(tokens, 4 * 64)  # the layout the kernel reads right
    rope.forward_cpu(positions, flat, torch.zeros(tokens, 64))
    assert relative_error(flat.view(tokens, 4, 64), expected) < 1e-6
    view = q.clone()
    rope.forward_cpu(positions, view[..., 32:], torch.zeros(tokens, 1, 64))  # as vLLM's MLA
    assert relative_error(view[..., 32:], expected) > 0.5
