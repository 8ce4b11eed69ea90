"""What the Mamba-2 hybrids' decoders read beyond their sizes (`kit.config.cache_kinds`):
Granite-4.0-H's multipliers and positions, and what a run of them refuses. Plain data: no torch.

Granite (transformers' `GraniteMoeHybridForCausalLM`, vLLM's `GraniteMoeHybridForCausalLM`):

    embeddings      × embedding_multiplier
    each sub-layer  residual + residual_multiplier × its output (the mixer's, the MLP's)
    attention       scores × attention_multiplier (in place of head_dim^-1/2); no RoPE where
                    position_embedding_type is "nope"
    logits          ÷ logits_scaling

Nemotron-H (dense: Mamba-2, attention and MLP-only layers) has none of these: its factors are 1.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass

from kit.config.families import INERT_KEYS
from kit.config.rope_params import rope
from kit.errors import ConfigError

POSITIONS = ("rope", "nope")
# Granite's keys the kit reads (`kit.config.cache_kinds`, `hybrid_fields`) or that do not change
# a forward's arithmetic (INERT_KEYS, training-only ones); any other is refused by name.
GRANITE_KEYS = {
    "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "vocab_size", "max_position_embeddings", "rms_norm_eps",
    "hidden_act", "tie_word_embeddings", "attention_bias", "layer_types", "layers_block_type",
    "rope_parameters", "rope_theta", "rope_scaling", "position_embedding_type",
    "embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling",
    "num_local_experts", "num_experts_per_tok", "shared_intermediate_size", "mamba_n_heads",
    "mamba_d_head", "mamba_d_state", "mamba_d_conv", "mamba_expand", "mamba_n_groups",
    "mamba_conv_bias", "mamba_proj_bias", "mamba_chunk_size", "time_step_limit",
    "router_aux_loss_coef", "output_router_logits", "normalization_function"}


@dataclass(frozen=True)
class HybridScales:
    """Granite's factors (1 where a family has none; `attention_multiplier` None: the usual
    head_dim^-1/2)."""

    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float | None = None
    logits_scaling: float = 1.0
    mlp_bias: bool = False  # Nemotron-H's MLP-only layers' biases


def time_step_limit(hf: dict) -> tuple[float, float]:
    """config.json's time_step_limit (transformers writes infinity as {"__float__":
    "Infinity"}), (0, inf) when absent."""
    def number(v):
        return float(v["__float__"]) if isinstance(v, dict) else float(v)
    low, high = hf.get("time_step_limit") or (0.0, math.inf)
    return number(low), number(high)


def hybrid_fields(hf: dict, family: str, name: str) -> dict:
    """RoPE's base and scaling, the layers without RoPE and the `ModelConfig.hybrid` factors."""
    theta, _, scaling = rope(hf, name)
    fields = {"rope_theta": theta, "rope_scaling": scaling,
              "hybrid": HybridScales(mlp_bias=bool(hf.get("mlp_bias")))}
    if family == "nemotron_h":  # its attention has no positions at all (NoPE)
        fields["nope_layers"] = tuple(range(len(hf.get("layers_block_type") or
                                                hf.get("hybrid_override_pattern") or ())))
    if family == "granitemoehybrid":
        fields["hybrid"] = HybridScales(
            float(hf.get("embedding_multiplier", 1.0)), float(hf.get("residual_multiplier", 1.0)),
            float(hf.get("attention_multiplier", 1.0)), float(hf.get("logits_scaling", 1.0)))
        if (hf.get("position_embedding_type") or "rope") == "nope":
            fields["nope_layers"] = tuple(range(hf["num_hidden_layers"]))
    return fields


def nemotron_problems(arch, hf: dict) -> list[str]:
    """What a Nemotron-H config.json asks that the kit does not build: its MoE layers (their
    experts are not gated: vLLM's CPU engine refuses them too, `is_act_and_mul=False`), MLPs
    other than relu², residuals in float32, multi-token prediction layers."""
    problems = []
    if arch.num_experts:
        problems.append("MoE layers (\"E\" / \"moe\": non-gated experts, which vLLM's CPU "
                        "engine refuses as well)")
    if arch.hidden_act != "relu2":
        problems.append(f"mlp_hidden_act {arch.hidden_act!r} (Nemotron-H's MLPs are relu²)")
    if hf.get("residual_in_fp32"):
        problems.append("residual_in_fp32 true")
    if hf.get("num_nextn_predict_layers"):
        problems.append("num_nextn_predict_layers (multi-token prediction)")
    return problems


def check_hybrid_run(arch) -> None:
    """Refuse by name, before any work, what a Granite or Nemotron-H config.json asks that the
    kit's decoder does not build."""
    hf, name = json.loads(arch.source_config or "{}"), arch.name
    problems = []
    if arch.family == "granitemoehybrid":
        unknown = sorted(k for k in hf if k not in GRANITE_KEYS | INERT_KEYS)
        if unknown:
            problems.append(f"unknown keys {unknown}")
    if (hf.get("normalization_function") or "rmsnorm") != "rmsnorm":
        problems.append(f"normalization_function {hf['normalization_function']!r} (the kit's "
                        "norms are RMSNorm)")
    if time_step_limit(hf) != (0.0, math.inf):
        problems.append(f"time_step_limit {list(time_step_limit(hf))} (vLLM's Mamba-2 kernels "
                        "take no limit on dt; transformers clamps the prefill's only)")
    position = hf.get("position_embedding_type") or "rope"
    if arch.family == "granitemoehybrid" and position not in POSITIONS:
        problems.append(f"position_embedding_type {position!r} (the kit builds {POSITIONS})")
    act = hf.get("mamba_hidden_act") or hf.get("hidden_act") or "silu"
    if act != "silu":
        problems.append(f"a {act!r} convolution activation (Mamba-2's is SiLU)")
    if arch.family == "granitemoehybrid" and arch.hidden_act != "silu":
        problems.append(f"hidden_act {arch.hidden_act!r} (Granite's MLPs are SiLU-gated)")
    rec = arch.recurrent
    if rec.heads % rec.groups or rec.inner % rec.norm_groups or rec.inner != rec.heads * rec.head_dim:
        problems.append(f"{rec.heads} Mamba heads of {rec.head_dim} in {rec.groups} groups "
                        f"(inner {rec.inner})")
    if arch.family == "nemotron_h":
        problems += nemotron_problems(arch, hf)
    if problems:
        raise ConfigError(f"model {name!r}: the kit's {arch.family} decoder does not build "
                          + "; ".join(problems))
