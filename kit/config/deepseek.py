"""What DeepSeek-V2's decoder reads beyond its sizes (`kit.config.cache_kinds`): how its
router picks experts and the scale of its latent attention's scores. Plain data: no torch.

As transformers' `DeepseekV2TopkRouter` and vLLM's `DeepseekV2MoE` (vllm/model_executor/
models/deepseek_v2.py) route:

    greedy                 the softmax (float32) over every expert's logit, its k largest
    group_limited_greedy   the experts split into n_group groups, each group scored by its
                           largest probability, only the topk_group best groups' experts
                           eligible, then their k largest
    then                   renormalised to sum to 1 where norm_topk_prob (vLLM's `renormalize`;
                           transformers 5.19's V2 router ignores the key), times
                           routed_scaling_factor

With YaRN, the scores are scaled by (qk_nope_head_dim + qk_rope_head_dim)^-1/2 × mscale²,
mscale = 0.1 · mscale_all_dim · ln(factor) + 1 (transformers' `yarn_apply_mscale`, vLLM's
`DeepseekV2MLAAttention`); cos and sin carry YaRN's own attention factor
(`kit.config.families.yarn_scaling`).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass

from kit.config.families import rope
from kit.errors import ConfigError

TOPK_METHODS = ("greedy", "group_limited_greedy")


@dataclass(frozen=True)
class DeepSeekRouting:
    """DeepSeek's router and its latent attention's score factor (`deepseek_fields`)."""

    topk_method: str = "greedy"
    n_group: int = 1               # groups of experts (group_limited_greedy)
    topk_group: int = 1            # groups a token's experts may come from
    routed_scaling_factor: float = 1.0
    score_factor: float = 1.0      # YaRN's mscale² on the scores (1 without YaRN)


def yarn_mscale(factor: float, mscale: float) -> float:
    """0.1 · mscale · ln(factor) + 1, 1 for factor ≤ 1 (`yarn_get_mscale`)."""
    return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0


def deepseek_fields(hf: dict, name: str) -> dict:
    """RoPE's base and scaling (on the qk_rope_head_dim rotary elements) and the
    `ModelConfig.deepseek` field, from config.json (read, not checked: sizing takes any
    DeepSeek config; a run checks it first, `check_latent_run`)."""
    theta, _, scaling = rope(hf, name)
    params = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    factor = 1.0
    if dict(scaling).get("rope_type") == "yarn" and params.get("mscale_all_dim"):
        factor = yarn_mscale(dict(scaling)["factor"], params["mscale_all_dim"]) ** 2
    return {"rope_theta": theta, "rope_scaling": scaling, "deepseek": DeepSeekRouting(
        hf.get("topk_method") or "greedy", hf.get("n_group") or 1, hf.get("topk_group") or 1,
        float(hf.get("routed_scaling_factor") or 1.0), factor)}


def check_latent_run(arch) -> None:
    """Refuse by name, before any work, what a DeepSeek config.json asks that the kit's decoder
    does not build: other routers (DeepSeek-V3's sigmoid scores with a bias, `noaux_tc`),
    biased projections (transformers would add them, vLLM builds none), other activations."""
    hf, name = json.loads(arch.source_config or "{}"), arch.name
    problems = []
    method, scoring = hf.get("topk_method") or "greedy", hf.get("scoring_func") or "softmax"
    if arch.num_experts and method not in TOPK_METHODS:
        problems.append(f"topk_method {method!r} (the kit routes {list(TOPK_METHODS)})")
    if arch.num_experts and scoring != "softmax":
        problems.append(f"scoring_func {scoring!r} (the kit routes by a softmax)")
    routing = arch.deepseek
    if method == "group_limited_greedy" and arch.num_experts % routing.n_group:
        problems.append(f"n_group {routing.n_group} does not divide {arch.num_experts} experts")
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            problems.append(f"{key} true (vLLM's DeepSeek-V2 builds no biases)")
    if arch.hidden_act != "silu":
        problems.append(f"hidden_act {arch.hidden_act!r} (DeepSeek's MLPs are SiLU-gated)")
    if problems:
        raise ConfigError(f"model {name!r}: the kit's DeepSeek-V2 decoder does not build "
                          + "; ".join(problems))
