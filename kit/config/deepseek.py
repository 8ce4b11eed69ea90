"""What DeepSeek-V2 and V3's decoder reads beyond its sizes (`kit.config.cache_kinds`): how its
router picks experts, the scale of its latent attention's scores, and which config.json keys a
run honours. Plain data: no torch.

As transformers' `DeepseekV2TopkRouter` / `DeepseekV3TopkRouter` and vLLM's `DeepseekV2MoE`
(vllm/model_executor/models/deepseek_v2.py, its CPU router `_grouped_topk` in
fused_moe/router/cpu_router.py) route:

    greedy                 (V2) the softmax (float32) over every expert's logit, its k largest
    group_limited_greedy   (V2) the experts split into n_group groups, each group scored by its
                           largest probability, only the topk_group best groups' experts
                           eligible, then their k largest
    noaux_tc               (V3, scoring_func "sigmoid") the sigmoid of each logit; a learned
                           per-expert bias (`e_score_correction_bias`) added for choosing
                           only: each group scored by the sum of its 2 best biased scores, the
                           topk_group best groups eligible, their k best biased scores picked,
                           each weighted by its unbiased sigmoid
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

from kit.config.families import INERT_KEYS
from kit.config.rope_params import rope
from kit.errors import ConfigError

# The routers each family's config.json may name, as (topk_method, scoring_func): V2's
# softmax routers, V3's sigmoid with the bias. transformers' V3 router reads neither key (it
# always routes noaux_tc), vLLM's reads both, defaulting to a softmax without the bias: a V3
# config.json must name them (real DeepSeek-V3 configs do).
LATENT_ROUTERS = {"deepseek_v2": (("greedy", "softmax"), ("group_limited_greedy", "softmax")),
           "deepseek_v3": (("noaux_tc", "sigmoid"),)}
# DeepseekV3Config's defaults for what it routes by (vLLM reads configs through that class)
V3_ROUTING = {"n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5}
# The config.json keys a DeepSeek run reads (`kit.config.cache_kinds.sized_only_fields`,
# `deepseek_fields`), besides the fixed ones below and those of the router (LATENT_ROUTERS).
LATENT_READ_KEYS = {
    "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "vocab_size", "max_position_embeddings", "rms_norm_eps", "rope_theta", "rope_scaling",
    "rope_parameters", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim",
    "v_head_dim", "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
    "n_shared_experts", "first_k_dense_replace", "norm_topk_prob", "routed_scaling_factor",
    "n_group", "topk_group", "topk_method", "scoring_func"}
# Keys neither transformers' forward nor vLLM's reads for the arithmetic: DeepSeek's training
# settings (aux_loss_alpha, seq_aux), its remote code's pointer (auto_map) and expert-parallel
# size (ep_size: vLLM takes its own), the multi-token-prediction layers (a drafter's: neither
# model's forward runs them), KV heads (latent attention has none: transformers' V3 writes 128
# whatever the heads, vLLM ignores it; transformers' eager attention fails unless it equals
# the heads, its SDPA does not read it), the head sizes transformers derives and writes
# (head_dim = qk_rope_head_dim, qk_head_dim = nope + rope: its __post_init__ overwrites them)
LATENT_INERT_KEYS = INERT_KEYS | {
    "auto_map", "aux_loss_alpha", "seq_aux", "ep_size", "num_nextn_predict_layers",
    "num_mtp_layers", "num_key_value_heads", "head_dim", "qk_head_dim"}
# Keys honoured at these values only (a missing key reads as the first): biases transformers
# would add and vLLM does not build, transformers' rotary halves where vLLM turns adjacent
# pairs, a tied LM head (vLLM builds its own), MoE layers off every layer from
# first_k_dense_replace (vLLM skips those off moe_layer_freq, transformers does not).
LATENT_FIXED = {"attention_bias": (False,), "mlp_bias": (False,), "pretraining_tp": (1,),
                "rope_interleave": (True,), "tie_word_embeddings": (False,),
                "moe_layer_freq": (1,), "hidden_act": ("silu",)}


@dataclass(frozen=True)
class DeepSeekRouting:
    """DeepSeek's router and its latent attention's score factor (`deepseek_fields`)."""

    topk_method: str = "greedy"
    n_group: int = 1               # groups of experts (group_limited_greedy, noaux_tc)
    topk_group: int = 1            # groups a token's experts may come from
    routed_scaling_factor: float = 1.0
    score_factor: float = 1.0      # YaRN's mscale² on the scores (1 without YaRN)
    scoring_func: str = "softmax"  # "sigmoid": noaux_tc's, with the learned bias

    @property
    def grouped(self) -> bool:
        """Whether a token's experts come from its topk_group best groups only."""
        return self.topk_method in ("group_limited_greedy", "noaux_tc")


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
    got = {**(V3_ROUTING if hf.get("model_type") == "deepseek_v3" else {}),
           **{k: v for k, v in hf.items() if v is not None}}
    return {"rope_theta": theta, "rope_scaling": scaling, "deepseek": DeepSeekRouting(
        got.get("topk_method") or "greedy", got.get("n_group") or 1,
        got.get("topk_group") or 1, float(got.get("routed_scaling_factor") or 1.0), factor,
        got.get("scoring_func") or "softmax")}


def key_problems(hf: dict) -> list[str]:
    """What of a DeepSeek config.json the run would not honour: keys it neither reads nor
    knows to be inert, and keys at values it does not build (`LATENT_FIXED`)."""
    known = LATENT_READ_KEYS | LATENT_INERT_KEYS | set(LATENT_FIXED)
    unknown = sorted(k for k in hf if k not in known)
    fixed = sorted(f"{k}={hf[k]!r} (built: {values[0]!r})" for k, values in LATENT_FIXED.items()
                   if hf.get(k, values[0]) not in values)
    return [f"keys it does not read: {unknown}"] * bool(unknown) + \
        [f"settings at values it does not build: {fixed}"] * bool(fixed)


def router_problems(arch, hf: dict) -> list[str]:
    """The router config.json names, against those the family routes by (`LATENT_ROUTERS`)."""
    if not arch.num_experts:
        return []
    family, routing = arch.family, arch.deepseek
    named = (hf.get("topk_method"), hf.get("scoring_func"))
    if family == "deepseek_v2":
        named = (named[0] or "greedy", named[1] or "softmax")
    problems = []
    if named not in LATENT_ROUTERS[family]:
        problems.append(
            f"topk_method {named[0]!r} with scoring_func {named[1]!r} ({family} routes "
            f"{' or '.join(f'{m!r} with {s!r}' for m, s in LATENT_ROUTERS[family])}"
            + ("; transformers' V3 router always routes so, vLLM's reads both keys and "
               "defaults to a softmax without the bias: write both into config.json"
               if family == "deepseek_v3" else "") + ")")
    per_group = arch.num_experts // routing.n_group
    if routing.grouped and (arch.num_experts % routing.n_group or per_group < (
            2 if named[0] == "noaux_tc" else 1) or not 1 <= routing.topk_group <= routing.n_group):
        problems.append(f"n_group {routing.n_group} and topk_group {routing.topk_group} for "
                        f"{arch.num_experts} experts (groups of equal size, 2 or more for "
                        "noaux_tc's scores of a group's 2 best; topk_group 1 to n_group)")
    return problems


def check_latent_run(arch) -> None:
    """Refuse by name, before any work, what a DeepSeek config.json asks that the kit's decoder
    does not build or does not read: every key is read (`LATENT_READ_KEYS`), inert
    (`LATENT_INERT_KEYS`), or at the one value built (`LATENT_FIXED`); the router is one its
    family routes by (`LATENT_ROUTERS`). Sizing takes any DeepSeek config (vLLM sizes them)."""
    hf = json.loads(arch.source_config or "{}")
    problems = key_problems(hf) + router_problems(arch, hf)
    if problems:
        raise ConfigError(f"model {arch.name!r}: config.json asks what the kit's "
                          f"{arch.family} decoder does not build: " + "; ".join(problems)
                          + ". The kit refuses rather than run a different model.")
