"""What Qwen3-Next's and Qwen3.5's decoders read beyond their sizes (`kit.config.cache_kinds`):
RoPE's base, scaling and the fraction of each head it turns, and, before a run, every key of
their config.json honoured or refused by name (`check_gated_delta_run`). Plain data: no torch.

As transformers' `Qwen3NextConfig` and vLLM's `Qwen3NextForCausalLM` read them: layers
`layer_types` or every `full_attention_interval`-th full attention, the rest gated delta-nets
(`linear_*` sizes); experts on every `decoder_sparse_step`-th layer but `mlp_only_layers`,
renormalised where `norm_topk_prob`, beside a shared expert; RoPE on the first
`partial_rotary_factor` of each head (top level, or in `rope_parameters`).

Qwen3.5's text model (transformers' `Qwen3_5TextConfig`, vLLM's `Qwen3_5ForCausalLM`) is the
same decoder with dense MLPs on every layer (no expert keys; its MoE sizes, `qwen3_5_moe_text`,
have Qwen3-Next's experts on every layer instead), its delta-net's projections stored
apart (`in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`), the recurrent state's dtype
(`mamba_ssm_dtype`, read by `kit.engine.hybrid_cache.state_dtypes`) and multimodal RoPE's
`mrope_section` / `mrope_interleaved`: each splits the turned frequencies among temporal,
height and width positions (`Qwen3_5TextRotaryEmbedding.recomposition_frequencies`, vLLM's
`MRotaryEmbedding`); a text prompt's three positions are one and the same, so every split
turns each frequency by that position: plain RoPE, whatever the sections say.
"""
from __future__ import annotations

import json

from kit.config.families import INERT_KEYS
from kit.config.rope_params import rope
from kit.errors import ConfigError

# The keys the kit's Qwen3-Next decoder reads (`sized_only_fields`, `qwen3_next_fields`).
READ = {"hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings",
        "rms_norm_eps", "rope_theta", "rope_parameters", "rope_scaling", "partial_rotary_factor",
        "hidden_act", "layer_types", "full_attention_interval", "linear_conv_kernel_dim",
        "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads",
        "linear_num_value_heads", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
        "shared_expert_intermediate_size", "decoder_sparse_step", "mlp_only_layers",
        "norm_topk_prob"}
EXPERT_KEYS = {"num_experts", "num_experts_per_tok", "moe_intermediate_size",
               "shared_expert_intermediate_size", "decoder_sparse_step", "mlp_only_layers",
               "norm_topk_prob"}
# Qwen3.5's (dense) decoder: no expert keys; the state's dtype (`rope_parameters`' mrope_*
# keys are inert on text: the module's docstring)
READ_3_5 = READ - EXPERT_KEYS | {"mamba_ssm_dtype"}
# Keys read only at one setting (what transformers and vLLM both build): no biases (vLLM's
# `qkv_bias`, transformers' `attention_bias`), a separate LM head (vLLM's Qwen3-Next never
# ties it), the output gate (transformers always gates), no sliding window.
FIXED = {"attention_bias": (False, None), "qkv_bias": (False, None),
         "tie_word_embeddings": (False, None), "attn_output_gate": (True, None),
         "use_sliding_window": (False, None), "sliding_window": (None,), "mlp_bias": (False,)}
# The multi-token prediction head's keys: speculative decoding's extra layer, which neither
# transformers' Qwen3NextForCausalLM nor a plain vLLM run builds.
MTP_KEYS = {"mtp_num_hidden_layers", "mtp_use_dedicated_embeddings", "num_nextn_predict_layers"}
# Qwen3.5's: each layer's output scaled by (1 + a stored vector) where `layer_scale` (vLLM's
# Qwen3NextDecoderLayer; transformers builds none); `output_gate_type` read by neither
# (both gate the delta-net's output by SiLU, "swish"); a tied LM head both build.
FIXED_3_5 = {**FIXED, "tie_word_embeddings": (False, True, None), "layer_scale": (False, None),
             "output_gate_type": ("swish", None)}
# Qwen3.5's MoE decoder (transformers' `Qwen3_5MoeTextConfig`, vLLM's `Qwen3_5MoeForCausalLM`):
# experts beside a gated shared expert on every layer (both build them whatever
# decoder_sparse_step or mlp_only_layers say), the picked probabilities always renormalised
# (transformers' router always does; vLLM reads norm_topk_prob, True where absent).
READ_3_5_MOE = READ_3_5 | {"num_experts", "num_experts_per_tok", "moe_intermediate_size",
                           "shared_expert_intermediate_size"}
FIXED_3_5_MOE = {**FIXED_3_5, "decoder_sparse_step": (1, None), "mlp_only_layers": ([], None),
                 "norm_topk_prob": (True, None)}
# Each family's keys read and fixed.
KEYS = {"qwen3_next": (READ, FIXED), "qwen3_5_text": (READ_3_5, FIXED_3_5),
        "qwen3_5_moe_text": (READ_3_5_MOE, FIXED_3_5_MOE)}
STATE_DTYPES = ("float32", "bfloat16", "float16", None)


FAMILY_NAMES = {"qwen3_next": "Qwen3-Next", "qwen3_5_text": "Qwen3.5",
                "qwen3_5_moe_text": "Qwen3.5 MoE"}


def rotary_fraction(hf: dict) -> float:
    """partial_rotary_factor in rope_parameters, else top level (transformers 5 moves it there,
    and its rotary embeddings and vLLM's `get_rope` read it there: where a config writes both,
    as transformers' writer does with its top-level default, rope_parameters' wins); 0.25,
    `Qwen3NextConfig.__post_init__`'s default, where neither says."""
    params = hf.get("rope_parameters") or {}
    return float(params.get("partial_rotary_factor") or hf.get("partial_rotary_factor") or 0.25)


def qwen3_next_fields(hf: dict, name: str) -> dict:
    """RoPE's base, scaling and turned fraction from config.json (read, not checked: sizing
    takes any Qwen3-Next config; a run checks it first, `check_gated_delta_run`)."""
    theta, _, scaling = rope(hf, name)
    return {"rope_theta": theta, "rope_scaling": scaling,
            "partial_rotary_factor": rotary_fraction(hf)}


def check_gated_delta_run(arch) -> None:
    """Refuse by name, before any work, each key of a Qwen3-Next config.json the kit's decoder
    neither reads nor holds inert, or holds at a setting it does not build."""
    hf, name = json.loads(arch.source_config or "{}"), arch.name
    read, fixed = KEYS[arch.family]
    unknown = sorted(set(hf) - read - INERT_KEYS - set(fixed) - MTP_KEYS)
    problems = [f"keys the kit's decoder does not build: {unknown}"] if unknown else []
    problems += [f"{key}={hf[key]!r} (the kit builds {allowed[0]!r})"
                 for key, allowed in fixed.items() if key in hf and hf[key] not in allowed]
    if "mamba_ssm_dtype" in read and hf.get("mamba_ssm_dtype") not in STATE_DTYPES:
        problems.append(f"mamba_ssm_dtype={hf['mamba_ssm_dtype']!r} (a state in float32, "
                        "bfloat16 or float16)")
    if arch.hidden_act != "silu":
        problems.append(f"hidden_act {arch.hidden_act!r} (Qwen3-Next's MLPs are SiLU-gated)")
    if arch.recurrent.heads % arch.recurrent.groups:
        problems.append(f"linear_num_value_heads {arch.recurrent.heads} is not a multiple of "
                        f"linear_num_key_heads {arch.recurrent.groups}")
    if problems:
        raise ConfigError(f"model {name!r}: the kit's {FAMILY_NAMES[arch.family]} decoder "
                          "does not build "
                          + "; ".join(problems))
