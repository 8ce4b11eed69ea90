"""The families whose cache is not a key and a value per KV head, read from config.json for
sizing: DeepSeek's multi-head latent attention (`deepseek_v2`, `deepseek_v3`) and the hybrids
of attention with recurrent layers, Mamba-2 (`granitemoehybrid`, `nemotron_h`) or gated
delta-nets (`qwen3_next`, `qwen3_5_text`, `qwen3_5_moe_text`). The kit sizes them as vLLM 0.32
does (weights, the KV cache's specs, blocks and concurrency), reading config.json here
(`Parts.sized_only`); its decoder runs them all (`Parts.runs`). Plain data: no torch.

Each family's keys are read as its transformers config class and vLLM's model read them:

    latent attention   a token keeps kv_lora_rank + qk_rope_head_dim elements, one for all heads
    Mamba-2 layer      a request keeps a convolution state, (d_conv - 1) × (inner + 2 ×
                       n_groups × d_state), and an SSM state, heads × head_dim × d_state
    gated delta-net    the same two, with inner = value heads × value head dim, n_groups =
                       key heads, d_state = key head dim (vLLM's `MambaStateShapeCalculator`)
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from kit.errors import ConfigError

# A layer's kind beyond attention (config.json's `layer_types`, transformers' names): a
# recurrent layer, and Nemotron-H's layers that are only an MLP (no mixer, no cache).
LINEAR, MLP_ONLY = "linear_attention", "mlp"
# Older names transformers remaps (`_LEGACY_LAYER_TYPE_REMAP`), and Nemotron-H's pattern letters.
LEGACY_LAYER_TYPES = {"mamba": LINEAR, "attention": "full_attention", "moe": MLP_ONLY}
NEMOTRON_PATTERN = {"M": LINEAR, "*": "full_attention", "-": MLP_ONLY, "E": MLP_ONLY}
LATENT_FAMILIES = ("deepseek_v2", "deepseek_v3")
STATE_FAMILIES = ("granitemoehybrid", "nemotron_h", "qwen3_next", "qwen3_5_text",
                  "qwen3_5_moe_text")
MAMBA2_FAMILIES, DELTA_FAMILIES = STATE_FAMILIES[:2], STATE_FAMILIES[2:]
# What each family's transformers config class assumes for a key config.json leaves out, where
# the reading below would assume otherwise (vLLM reads configs through those classes too).
SIZED_DEFAULTS = {
    "deepseek_v2": {"q_lora_rank": 1536, "n_routed_experts": 64, "n_shared_experts": 2},
    "deepseek_v3": {"q_lora_rank": 1536, "n_routed_experts": 256, "n_shared_experts": 1,
                    "moe_intermediate_size": 2048, "first_k_dense_replace": 3,
                    "num_experts_per_tok": 8, "norm_topk_prob": True, "num_key_value_heads": 128},
    "granitemoehybrid": {"num_local_experts": 8, "num_experts_per_tok": 2,
                         "shared_intermediate_size": 1024, "mamba_conv_bias": True},
    "nemotron_h": {"num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 21504,
                   "n_routed_experts": 8, "moe_intermediate_size": 7688,
                   "moe_shared_expert_intermediate_size": 7688, "num_experts_per_tok": 2,
                   "norm_topk_prob": True, "use_conv_bias": True},
    "qwen3_next": {"num_key_value_heads": 2, "head_dim": 256, "intermediate_size": 5632,
                   "num_experts": 512, "num_experts_per_tok": 10, "moe_intermediate_size": 512,
                   "shared_expert_intermediate_size": 512, "norm_topk_prob": True},
    "qwen3_5_text": {"num_key_value_heads": 4, "head_dim": 256, "intermediate_size": 12288},
    "qwen3_5_moe_text": {"num_key_value_heads": 2, "head_dim": 256, "num_experts": 256,
                         "num_experts_per_tok": 8, "moe_intermediate_size": 512,
                         "shared_expert_intermediate_size": 512, "norm_topk_prob": True},
}
# vLLM's models of these families build a separate LM head even where config.json ties it
# (DeepseekV2ForCausalLM, NemotronHForCausalLM, Qwen3NextForCausalLM): only these tie.
TIED_FAMILIES = ("granitemoehybrid", "qwen3_5_text", "qwen3_5_moe_text")


@dataclass(frozen=True)
class Recurrent:
    """One recurrent layer's state sizes (every recurrent layer of a model alike)."""

    kind: str          # "mamba2" or "gated_delta_net"
    conv_kernel: int   # the convolution's width; its state keeps the last conv_kernel - 1 inputs
    heads: int         # Mamba-2 heads, or a delta-net's value heads
    head_dim: int      # their size
    state_dim: int     # Mamba-2's d_state, or a delta-net's key head size
    groups: int        # Mamba-2's n_groups (B and C), or a delta-net's key heads
    inner: int         # the mixer's width: heads × head_dim
    ssm_dtype: str | None = None  # the temporal state's dtype where config.json sets it
    conv_bias: bool = False  # the convolution's bias (Mamba-2's conv_bias)
    proj_bias: bool = False  # the input and output projections' biases (Mamba-2's)
    chunk_size: int = 256    # a prefill's scan runs by chunks of this many positions
    norm_groups: int = 1     # the gated norm's groups (vLLM's `Mixer2RMSNormGated`)

    def groups_per_rank(self, tp: int) -> int:
        """Mamba-2's groups, extended so every rank holds whole ones (vLLM's
        `extra_groups_for_head_shards`); a delta-net's key heads are split as they are."""
        if self.kind == "mamba2" and self.groups % tp:
            return tp
        return self.groups

    def conv_elements(self, tp: int = 1) -> int:
        """One rank's convolution state: (conv_kernel - 1) × conv_dim / tp."""
        return (self.conv_kernel - 1) * (self.inner + 2 * self.groups_per_rank(tp)
                                         * self.state_dim) // tp

    def ssm_elements(self, tp: int = 1) -> int:
        """One rank's temporal state: heads / tp × head_dim × state_dim."""
        return self.heads // tp * self.head_dim * self.state_dim


def layer_kinds(hf: dict, family: str, name: str) -> tuple:
    """Each layer's kind: FULL attention, LINEAR (recurrent) or MLP_ONLY (Nemotron-H)."""
    n = hf.get("num_hidden_layers")
    kinds = hf.get("layer_types") or hf.get("layers_block_type")
    if family in LATENT_FAMILIES:
        kinds = ["full_attention"] * n
    elif kinds is None and "hybrid_override_pattern" in hf:
        kinds = [NEMOTRON_PATTERN.get(c, c) for c in hf["hybrid_override_pattern"]]
    elif kinds is None and family in DELTA_FAMILIES:
        every = hf.get("full_attention_interval") or 4
        kinds = ["full_attention" if (i + 1) % every == 0 else LINEAR for i in range(n)]
    kinds = tuple(LEGACY_LAYER_TYPES.get(k, k) for k in kinds or ())
    if not kinds or set(kinds) - {"full_attention", LINEAR, MLP_ONLY}:
        raise ConfigError(f"model {name!r}: its layers must each be attention, recurrent or an "
                          f"MLP; config.json gives {list(kinds) or None}")
    if family == "nemotron_h" and n and n != len(kinds):
        raise ConfigError(f"model {name!r}: num_hidden_layers={n} but its pattern names "
                          f"{len(kinds)} layers")
    return kinds


def recurrent_of(hf: dict, family: str) -> Recurrent | None:
    """The recurrent layers' state sizes, in each family's keys."""
    h = hf["hidden_size"]
    if family == "granitemoehybrid":
        inner = hf.get("mamba_expand", 2) * h
        heads = hf.get("mamba_n_heads", 128)
        head_dim = hf.get("mamba_d_head", "auto")
        return Recurrent("mamba2", hf.get("mamba_d_conv", 4), heads,
                         inner // heads if head_dim == "auto" else head_dim,
                         hf.get("mamba_d_state", 256), hf.get("mamba_n_groups", 1), inner,
                         conv_bias=bool(hf.get("mamba_conv_bias")),
                         proj_bias=bool(hf.get("mamba_proj_bias")),
                         chunk_size=hf.get("mamba_chunk_size") or 256,
                         norm_groups=hf.get("mamba_n_groups", 1))
    if family == "nemotron_h":
        heads, head_dim = hf.get("mamba_num_heads", 128), hf.get("mamba_head_dim", 64)
        return Recurrent("mamba2", hf.get("conv_kernel", 4), heads, head_dim,
                         hf.get("ssm_state_size", 128), hf.get("n_groups", 8), heads * head_dim,
                         hf.get("mamba_ssm_cache_dtype") or "float32",
                         conv_bias=bool(hf.get("use_conv_bias")),
                         proj_bias=bool(hf.get("use_bias")),
                         chunk_size=hf.get("chunk_size") or 128,
                         norm_groups=hf.get("n_groups", 8))
    if family in DELTA_FAMILIES:
        heads, head_dim = hf.get("linear_num_value_heads", 32), hf.get("linear_value_head_dim", 128)
        return Recurrent("gated_delta_net", hf.get("linear_conv_kernel_dim", 4), heads, head_dim,
                         hf.get("linear_key_head_dim", 128), hf.get("linear_num_key_heads", 16),
                         heads * head_dim, hf.get("mamba_ssm_dtype"))  # Qwen3.5's key
    return None


def experts_fields(hf: dict, family: str, kinds: tuple) -> dict:
    """Each layer's MLP and the experts' sizes: DeepSeek's routed experts from layer
    first_k_dense_replace on (every moe_layer_freq-th) beside n_shared_experts shared ones,
    Granite's on every layer beside one shared MLP, Qwen3-Next's on every decoder_sparse_step-th
    layer but its mlp_only_layers beside one shared expert, Nemotron-H's "moe" layers."""
    n = len(kinds)
    if family in LATENT_FAMILIES:
        routed, size = hf.get("n_routed_experts"), hf.get("moe_intermediate_size", 1407)
        first, every = hf.get("first_k_dense_replace", 0), hf.get("moe_layer_freq", 1)
        mlp = tuple("experts" if routed and i >= first and i % every == 0 else "dense"
                    for i in range(n))
        shared = (hf.get("n_shared_experts") or 0) * size
    elif family == "granitemoehybrid":
        routed, size = hf.get("num_local_experts"), hf["intermediate_size"]
        mlp, shared = ("experts" if routed else "dense",) * n, hf.get("shared_intermediate_size", 0)
        if not routed:  # its one MLP is the shared one (vLLM builds none when that is 0 wide)
            return {"mlp_kinds": mlp if shared else ("none",) * n, "intermediate_size": shared}
    elif family == "nemotron_h":
        routed, size = hf.get("n_routed_experts"), hf.get("moe_intermediate_size", 0)
        raw = hf.get("layers_block_type") or [
            {"E": "moe"}.get(c, c) for c in hf.get("hybrid_override_pattern", "")]
        mlp = tuple("experts" if t == "moe" else "dense" if k == MLP_ONLY else "none"
                    for t, k in zip(raw or kinds, kinds))
        shared = (hf.get("moe_shared_expert_intermediate_size") or 0) * (hf.get(
            "n_shared_experts", 1) or 0) if "experts" in mlp else 0  # (vLLM's width)
    else:
        routed, size = hf.get("num_experts"), hf.get("moe_intermediate_size", 0)
        step, dense = hf.get("decoder_sparse_step") or 1, set(hf.get("mlp_only_layers") or ())
        mlp = tuple("experts" if routed and (i + 1) % step == 0 and i not in dense else "dense"
                    for i in range(n))
        shared = hf.get("shared_expert_intermediate_size", 0) if routed else 0
    if "experts" not in mlp:
        return {"mlp_kinds": mlp}
    return {"mlp_kinds": mlp, "num_experts": routed, "moe_intermediate_size": size,
            "num_experts_per_tok": hf.get("num_experts_per_tok", 1),
            "norm_topk_prob": bool(hf.get("norm_topk_prob")),
            "shared_expert_intermediate_size": shared, "router_score_bias":
                family == "nemotron_h" or hf.get("topk_method") == "noaux_tc",
            "moe_latent_size": hf.get("moe_latent_size") or 0}


def latent_fields(hf: dict) -> dict:
    """Latent attention's sizes: the latent and rotary key a token keeps, and the query's
    and value's head sizes (its weights)."""
    return {"kv_lora_rank": hf.get("kv_lora_rank", 512),
            "qk_rope_head_dim": hf.get("qk_rope_head_dim", 64),
            "qk_nope_head_dim": hf.get("qk_nope_head_dim", 128),
            "v_head_dim": hf.get("v_head_dim", 128), "q_lora_rank": hf.get("q_lora_rank")}


def sized_only_fields(hf: dict, family: str, name: str) -> dict:
    """Every `ModelConfig` field of a family the kit sizes but does not run, and the user's
    config.json itself (`source_config`: what vLLM is given to compare against). Biases as
    vLLM builds them: DeepSeek's and Nemotron-H's attention has none whatever config.json
    says, Qwen3-Next's Q, K and V have them with `qkv_bias` (transformers' attention_bias)."""
    source, hf = hf, {**SIZED_DEFAULTS[family], **hf}
    missing = [k for k in ("hidden_size", "num_attention_heads", "vocab_size") if k not in hf]
    if missing:
        raise ConfigError(f"model {name!r}: config.json lacks {missing}")
    kinds = layer_kinds(hf, family, name)
    heads = hf["num_attention_heads"]
    latent = latent_fields(hf) if family in LATENT_FAMILIES else {}
    head_dim = latent["qk_nope_head_dim"] + latent["qk_rope_head_dim"] if latent \
        else hf.get("head_dim") or hf["hidden_size"] // heads
    return {
        "hidden_size": hf["hidden_size"], "intermediate_size": hf.get("intermediate_size", 0),
        "num_hidden_layers": len(kinds), "num_attention_heads": heads,
        "num_key_value_heads": hf.get("num_key_value_heads") or heads, "head_dim": head_dim,
        "vocab_size": hf["vocab_size"],
        "max_position_embeddings": hf.get("max_position_embeddings", 4096),
        "rms_norm_eps": hf.get("rms_norm_eps") or hf.get("layer_norm_epsilon") or 1e-6,
        "rope_theta": hf.get("rope_theta") or 10000.0,
        "hidden_act": hf.get("hidden_act") or hf.get("mlp_hidden_act") or "silu",
        "tie_word_embeddings": family in TIED_FAMILIES and bool(hf.get("tie_word_embeddings")),
        "attention_bias": bool(hf.get("qkv_bias") if family.startswith("qwen3") else
                               family == "granitemoehybrid" and hf.get("attention_bias")),
        "attn_output_gate": family.startswith("qwen3") and bool(hf.get("attn_output_gate", True)),
        "torch_dtype": hf.get("torch_dtype") or hf.get("dtype") or "bfloat16",
        "layer_types": kinds, "recurrent": recurrent_of(hf, family),
        "source_config": json.dumps(source, sort_keys=True),
        **latent, **experts_fields(hf, family, kinds)}
