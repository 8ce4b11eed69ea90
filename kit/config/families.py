"""The model families the decoder builds, and how a config.json is read: what each family is
made of (`Parts`), its transformers defaults, the keys read, inert or refused, each layer's
attention kind and RoPE. Plain data and checks: no torch."""
from __future__ import annotations

from dataclasses import dataclass

from kit.errors import ConfigError

# Where a decoder layer's norms sit (`Parts.layer`) -> their names in checkpoints.
LAYER_NORMS = {
    "pre_norm": ("input_layernorm", "post_attention_layernorm"),  # before attention, before MLP
    # Gemma 2 and 3: around attention and around the MLP, each output normed before it is added
    "sandwich": ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                 "post_feedforward_layernorm"),
    # Nemotron-H: one norm, then one mixer (Mamba-2, attention) or an MLP alone
    "mixer": ("norm",),
}
# A layer's attention kind, as config.json's `layer_types` names it: a full layer attends to
# every earlier position, a sliding one to the last `sliding_window` (itself included).
FULL, SLIDING = "full_attention", "sliding_attention"
# Llama 4's RoPE layers: a token attends only to the earlier tokens of its own chunk of
# `attention_chunk_size` positions (positions p and q share a chunk when p // C == q // C).
CHUNKED = "chunked_attention"


@dataclass(frozen=True)
class Parts:
    """What a family's decoder is built from besides its sizes: `kit.engine.model` assembles it
    from the parts named here (kit/engine/layers). Plain data (no torch), so validation, the
    parameter count and the checkpoint layout read it too. A new trait is a field here, its
    default what the other families do, and a part there."""

    architecture: str               # config.json's "architectures" entry
    attention_bias: bool = False    # Q, K and V biases, unless config.json says otherwise
    tie_word_embeddings: bool = False  # the LM head is the embedding, unless config.json says
    norm: str = "rms"               # a kind in kit.engine.layers.norm.NORMS
    layer: str = "pre_norm"         # where a layer's norms sit (LAYER_NORMS)
    scale_embeddings: bool = False  # embeddings times sqrt(hidden_size), in the model dtype
    gelu: str = "gelu"              # the activation config.json's "gelu" stands for
    qk_norm: bool = False           # each head's query and key normed before RoPE (q_norm, k_norm)
    experts: str | None = None      # how a token picks its experts (ROUTERS); None: dense MLPs
    expert_names: str = "qwen"      # the checkpoint's names for them (EXPERT_NAMES)
    # gpt-oss: a learned logit per head joins each softmax's denominator (`sinks`); with
    # attention_bias the output projection is biased too (`o_bias`); the router and experts
    # carry biases and the experts' activation is the clamped SwiGLU (`expert_act`)
    sinks: bool = False
    o_bias: bool = False
    expert_bias: bool = False
    expert_act: str = "gated"       # "gated": act(gate) × up; "clamped_swiglu": gpt-oss's
    # Llama 4: a shared expert (a dense gated MLP) beside the routed ones on every MoE layer,
    # each token's input scaled by its router weight before its expert (not the output after),
    # the MLP's checkpoint name (`mlp_name`), and RoPE's pairs of adjacent elements
    # ("interleaved": Meta's layout, permuted to the kit's halves at load, as vLLM does)
    shared_expert: bool = False
    experts_scale_input: bool = False
    mlp_name: str = "mlp"
    rope_pairs: str = "halves"
    # Gemma 4 (kit.config.gemma4): V normed without a scale (`v_norm`), scores not divided by
    # sqrt(head_dim) (`unscaled_scores`: the Q and K norms set their scale), each layer's
    # output times a stored scalar (`layer_scalar`), and the config's KV-shared layers, K = V
    # projections, wider global heads and per-layer embeddings (`gemma4`)
    v_norm: bool = False
    unscaled_scores: bool = False
    layer_scalar: bool = False
    gemma4: bool = False
    # Qwen3-Next's and Qwen3.5's: the shared expert's output gated by a sigmoid of the token
    # (`shared_expert_gate`, H × 1), the gated delta-net's input projections as stored
    # ("grouped": in_proj_qkvz and in_proj_ba, rows grouped by key head; "apart": Qwen3.5's
    # in_proj_qkv, in_proj_z, in_proj_b and in_proj_a)
    shared_expert_gate: bool = False
    delta_projections: str = "grouped"
    # sized by kit.config.cache_kinds (latent, Mamba-2, delta-nets); `runs`: built by the decoder
    sized_only: bool = False
    runs: bool = True

    @property
    def layer_norms(self) -> tuple[str, ...]:
        return LAYER_NORMS[self.layer]


# model_type in config.json -> what the decoder is built from.
FAMILIES = {
    "llama": Parts("LlamaForCausalLM"),
    "mistral": Parts("MistralForCausalLM"),
    "qwen2": Parts("Qwen2ForCausalLM", attention_bias=True),
    # Gemma's "gelu" is the tanh approximation, what Gemma actually runs (vLLM does the same)
    "gemma": Parts("GemmaForCausalLM", norm="gemma_rms", scale_embeddings=True,
                   gelu="gelu_pytorch_tanh", tie_word_embeddings=True),
    "qwen3": Parts("Qwen3ForCausalLM", qk_norm=True),
    "gemma2": Parts("Gemma2ForCausalLM", norm="gemma_rms", layer="sandwich",
                    scale_embeddings=True, gelu="gelu_pytorch_tanh", tie_word_embeddings=True),
    "gemma3_text": Parts("Gemma3ForCausalLM", norm="gemma_rms", layer="sandwich",
                         scale_embeddings=True, gelu="gelu_pytorch_tanh", qk_norm=True,
                         tie_word_embeddings=True),
    "gemma4_text": Parts("Gemma4ForCausalLM", layer="sandwich", scale_embeddings=True,
                         gelu="gelu_pytorch_tanh", qk_norm=True, tie_word_embeddings=True,
                         v_norm=True, unscaled_scores=True, layer_scalar=True, gemma4=True,
                         experts="softmax_topk"),  # where enable_moe_block (kit.config.gemma4)
    "qwen3_moe": Parts("Qwen3MoeForCausalLM", qk_norm=True, experts="softmax_topk"),
    "mixtral": Parts("MixtralForCausalLM", experts="softmax_topk", expert_names="mixtral"),
    "gpt_oss": Parts("GptOssForCausalLM", attention_bias=True, experts="topk_softmax",
                     expert_names="gpt_oss", sinks=True, o_bias=True, expert_bias=True,
                     expert_act="clamped_swiglu"),
    # Llama 4's text decoder: chunked local attention on its RoPE layers, full attention
    # without RoPE (NoPE) on the others, MoE layers every `interleave_moe_layer_step`
    "llama4_text": Parts("Llama4ForCausalLM", experts="topk_sigmoid", expert_names="llama4",
                         shared_expert=True, experts_scale_input=True, mlp_name="feed_forward",
                         rope_pairs="interleaved"),
    # Caches not K and V per head (kit.config.cache_kinds): sized; those with `runs` run too
    "deepseek_v2": Parts("DeepseekV2ForCausalLM", sized_only=True, experts="softmax_topk"),
    "deepseek_v3": Parts("DeepseekV3ForCausalLM", sized_only=True, experts="softmax_topk"),
    "granitemoehybrid": Parts("GraniteMoeHybridForCausalLM", sized_only=True,
                              experts="topk_softmax", shared_expert=True),
    "nemotron_h": Parts("NemotronHForCausalLM", sized_only=True, layer="mixer"),  # (MoE refused)
    "qwen3_next": Parts("Qwen3NextForCausalLM", sized_only=True, norm="gemma_rms",
                        qk_norm=True, experts="softmax_topk", shared_expert_gate=True),
    "qwen3_5_text": Parts("Qwen3_5ForCausalLM", sized_only=True, norm="gemma_rms", qk_norm=True,
                          delta_projections="apart"),
    "qwen3_5_moe_text": Parts("Qwen3_5MoeForCausalLM", sized_only=True, norm="gemma_rms",
                              qk_norm=True, experts="softmax_topk", shared_expert_gate=True,
                              delta_projections="apart"),
}
# How a token picks its experts (`Parts.experts`): "softmax_topk" takes the softmax over every
# expert's logit in float32, then the k largest probabilities, renormalised to sum to 1 where
# the config says so (Mixtral always, Qwen3-MoE with `norm_topk_prob`); "topk_softmax"
# (gpt-oss) takes the k largest logits, then the softmax over those k; "topk_sigmoid" (Llama 4)
# the k largest logits, then the sigmoid of each (no normalisation).
ROUTERS = ("softmax_topk", "topk_softmax", "topk_sigmoid")
# A checkpoint's names for one MoE layer's router and expert e's matrices (`Parts.expert_names`):
# (block, router, gate, up, down), as the published checkpoints and transformers write them.
EXPERT_NAMES = {"qwen": ("mlp", "gate", "gate_proj", "up_proj", "down_proj"),
                "mixtral": ("block_sparse_moe", "gate", "w1", "w3", "w2"),
                # gpt-oss: every expert in one tensor per matrix (kit.engine.checkpoint)
                "gpt_oss": ("mlp", "router", "gate_up_proj", "gate_up_proj", "down_proj"),
                # Llama 4: stacked too, gate's columns then up's ([E, H, 2I]), no biases
                "llama4": ("feed_forward", "router", "gate_up_proj", "gate_up_proj", "down_proj")}
# What each family's transformers config class assumes for a key config.json leaves out, where
# that differs from the kit's plain reading (vLLM reads configs through those classes too):
# a Gemma 2 config without caps is capped at 50 and 30, a Mistral one without sliding_window
# slides over 4,096 tokens.
CONFIG_DEFAULTS = {
    "gemma": {"head_dim": 256, "hidden_act": "gelu_pytorch_tanh",
              "max_position_embeddings": 8192},
    "gemma2": {"head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
               "max_position_embeddings": 8192, "query_pre_attn_scalar": 256,
               "sliding_window": 4096, "attn_logit_softcapping": 50.0,
               "final_logit_softcapping": 30.0},
    "gemma3_text": {"head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
                    "max_position_embeddings": 131_072, "query_pre_attn_scalar": 256,
                    "sliding_window": 4096},
    "mistral": {"sliding_window": 4096, "max_position_embeddings": 131_072},
    "qwen3": {"head_dim": 128, "sliding_window": 4096, "max_window_layers": 28,
              "max_position_embeddings": 32_768},
    # (transformers 5.19 writes Qwen3-MoE's `num_experts` as `num_local_experts`)
    "qwen3_moe": {"max_position_embeddings": 32_768, "num_local_experts": 128,
                  "num_experts_per_tok": 8, "moe_intermediate_size": 768,
                  "decoder_sparse_step": 1, "norm_topk_prob": False},
    "mixtral": {"max_position_embeddings": 131_072, "num_local_experts": 8,
                "num_experts_per_tok": 2, "rms_norm_eps": 1e-5},
    "gpt_oss": {"head_dim": 64, "sliding_window": 128, "max_position_embeddings": 131_072,
                "rms_norm_eps": 1e-5, "num_local_experts": 128, "num_experts_per_tok": 4,
                "swiglu_alpha": 1.702, "swiglu_limit": 7.0},
    # Llama4TextConfig's defaults (Llama 4 Scout's shape) for what is not a size
    "llama4_text": {"head_dim": 128, "max_position_embeddings": 131_072, "rms_norm_eps": 1e-5,
                    "intermediate_size_mlp": 16_384, "num_local_experts": 16,
                    "num_experts_per_tok": 1, "interleave_moe_layer_step": 1,
                    "use_qk_norm": True, "no_rope_layer_interval": 4,
                    "attention_chunk_size": 8192, "attn_temperature_tuning": True,
                    "floor_scale": 8192, "attn_scale": 0.1},
}
# Gemma4TextConfig's defaults (its dataclass fields; global_head_dim is its __post_init__'s)
CONFIG_DEFAULTS["gemma4_text"] = {
    "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 131_072,
    "sliding_window": 512, "vocab_size_per_layer_input": 262_144,
    "hidden_size_per_layer_input": 256, "num_kv_shared_layers": 0, "attention_k_eq_v": False,
    "use_double_wide_mlp": False, "enable_moe_block": False, "global_head_dim": 512,
    "rms_norm_eps": 1e-6, "num_key_value_heads": 4}
# Gemma 4's RoPE when config.json gives no `rope_parameters` (Gemma4TextConfig.__post_init__)
GEMMA4_ROPE = {SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
               FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                      "rope_theta": 1_000_000.0}}
# Gemma 3's RoPE bases when config.json gives neither `rope_theta` nor `rope_parameters`
GEMMA3_ROPE = {"rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0}
# gpt-oss's RoPE when config.json gives no `rope_parameters`: its base, and YaRN's scaling
# unless `rope_scaling` is given (GptOssConfig.__post_init__)
GPT_OSS_ROPE = {"rope_theta": 150_000.0, "rope_scaling": {
    "rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
    "truncate": False, "original_max_position_embeddings": 4096}}


def with_family_defaults(hf: dict, family: str) -> dict:
    """`hf` with its family's transformers defaults for the keys it leaves out."""
    defaults = dict(CONFIG_DEFAULTS.get(family, {}))
    if family == "gemma3_text" and "rope_parameters" not in hf:
        defaults.update(GEMMA3_ROPE)
    if family == "gpt_oss" and not hf.get("rope_parameters"):
        defaults.update(GPT_OSS_ROPE)
    if family == "llama4_text" and not hf.get("rope_parameters"):
        defaults["rope_theta"] = 500_000.0  # Llama4TextConfig.default_theta
    return {**defaults, **hf}


# Kinds of model the decoder does not build, refused before any work by what they need.
OUT_OF_REACH = {
    "multi-head latent attention": ("kimi_k2", "minicpm3", "deepseek_v32"),
    "mixture of experts": ("qwen2_moe", "dbrx", "olmoe", "granitemoe", "jamba", "glm4_moe",
                           "minimax_m2"),
    "state-space or linear-attention layers": ("mamba", "mamba2", "falcon_h1", "bamba",
                                               "zamba2", "lfm2"),
}
# config.json keys that never change a forward pass's arithmetic (token ids, training-only
# settings, bookkeeping); every other key is read (`ModelConfig.from_dict`) or refused by name.
INERT_KEYS = {
    "architectures", "model_type", "bos_token_id", "eos_token_id", "pad_token_id",
    "initializer_range", "use_cache", "transformers_version", "attention_dropout",
    "_name_or_path", "torch_dtype", "dtype", "cache_implementation", "output_attentions",
    "output_hidden_states", "return_dict", "tie_word_embeddings", "id2label", "label2id",
    "problem_type", "chunk_size_feed_forward", "is_encoder_decoder", "tokenizer_class",
    "_sliding_window_pattern",  # Gemma 3's class keeps sliding_window_pattern under this name
    "router_jitter_noise", "output_router_logits", "router_aux_loss_coef",  # training only
    "for_llm_compressor",  # Llama 4's published text config: a flag for llm-compressor
}
# Keys the decoder honours only at the values listed (what every family it builds uses).
FIXED_KEYS = {"mlp_bias": (False,), "pretraining_tp": (1,), "partial_rotary_factor": (1, 1.0),
              "use_bidirectional_attention": (False, None)}
# The keys `ModelConfig.from_dict` reads.
READ_KEYS = {
    "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings", "rms_norm_eps",
    "rope_theta", "rope_parameters", "rope_scaling", "rope_local_base_freq", "hidden_act",
    "hidden_activation", "attention_bias", "layer_types", "sliding_window", "use_sliding_window",
    "max_window_layers", "sliding_window_pattern", "query_pre_attn_scalar",
    "attn_logit_softcapping", "final_logit_softcapping",
}
# The keys of a mixture of experts, read for the families whose MLPs route (`Parts.experts`)
# and refused for the others.
MOE_KEYS = {"num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size",
            "decoder_sparse_step", "mlp_only_layers", "norm_topk_prob"}
# gpt-oss's own keys instead: the clamped SwiGLU's gain and clamp, `experts_per_token` (the
# published config's copy of num_experts_per_tok, which transformers ignores: it must equal
# it) and `initial_context_length` (OpenAI's name for YaRN's original context, read by neither
# transformers nor vLLM: inert).
GPT_OSS_KEYS = {"num_experts", "num_local_experts", "num_experts_per_tok", "swiglu_alpha",
                "swiglu_limit", "experts_per_token", "initial_context_length"}
# Llama 4's own keys (Llama4TextConfig), read by `kit.config.llama4`.
LLAMA4_KEYS = {"num_local_experts", "num_experts_per_tok", "intermediate_size_mlp",
               "moe_layers", "interleave_moe_layer_step", "use_qk_norm", "no_rope_layers",
               "no_rope_layer_interval", "attention_chunk_size", "attn_temperature_tuning",
               "floor_scale", "attn_scale"}
# The multimodal wrappers whose text decoder the kit builds under its own model_type.
TEXT_DECODERS = {"llama4": "llama4_text"}
# The keys Gemma 4 adds (kit.config.gemma4); its MoE keys are read to be refused by name.
GEMMA4_KEYS = {"global_head_dim", "num_global_key_value_heads", "num_kv_shared_layers",
               "attention_k_eq_v", "hidden_size_per_layer_input", "vocab_size_per_layer_input",
               "use_double_wide_mlp", "enable_moe_block", "per_layer_config", "num_experts",
               "top_k_experts", "moe_intermediate_size"}
# Gemma 4's "vision": image tokens attend to each other both ways, text tokens causally (the
# text decoder never sees an image token).
GEMMA4_FIXED = {"use_bidirectional_attention": ("vision",)}
# Keys other families read that Gemma 4's classes do not (its RoPE is `rope_parameters`, its
# scores unscaled and uncapped, its activation `hidden_activation`): refused, not ignored.
GEMMA4_UNREAD = {"rope_theta", "rope_scaling", "rope_local_base_freq", "query_pre_attn_scalar",
                 "attn_logit_softcapping", "use_sliding_window", "max_window_layers",
                 "sliding_window_pattern", "hidden_act"}
ACTIVATIONS = {"silu", "gelu", "gelu_pytorch_tanh", "gelu_new"}


def check_family(family, name: str) -> None:
    """A model_type the decoder builds; kinds it cannot build refused by what they need."""
    if family in FAMILIES:
        return
    if family in TEXT_DECODERS:
        raise ConfigError(
            f"model {name!r}: model_type {family!r} is the multimodal model (a vision encoder "
            f"and a text decoder); the kit builds its text decoder, model_type "
            f"{TEXT_DECODERS[family]!r}: give the config.json's text_config (with "
            f"\"model_type\": \"{TEXT_DECODERS[family]}\") instead.")
    need = next((what for what, types in OUT_OF_REACH.items() if family in types), None)
    raise ConfigError(
        f"model {name!r}: model_type {family!r} is not supported"
        f"{f' (it needs {need}, which the kit does not build)' if need else ''}; the kit's "
        f"decoder covers {runnable_families()}: RMSNorm, RoPE, a gated MLP or experts routed "
        "by a softmax's top k (or a top k's softmax), grouped-query attention over full or "
        "sliding windows, with or without sinks, Llama 4's chunked local and NoPE layers, "
        "DeepSeek's latent attention, Mamba-2 (Granite, Nemotron-H) or Qwen3-Next's and "
        "Qwen3.5's gated delta-nets.")


def runnable_families(sized_only: bool = False) -> list[str]:
    """The model_types the decoder builds and runs (`sized_only`: those it only sizes)."""
    return sorted(f for f, parts in FAMILIES.items() if parts.runs != sized_only)


def check_unquantized(hf: dict, name: str) -> None:
    """The kit sizes and builds unquantized weights: a quantization_config is refused."""
    if "quantization_config" in hf:
        method = (hf["quantization_config"] or {}).get("quant_method", "?")
        raise ConfigError(
            f"model {name!r}: config.json has quantization_config (quant_method {method!r}); "
            "the kit builds the unquantized model (bf16 weights): drop the quantization_config "
            "key from config.json to size or run it so.")


def check_keys(hf: dict, name: str) -> None:
    """Every key of config.json is read, inert or at the one value the decoder builds; any
    other is refused by name (a key ignored would run a model the user did not give)."""
    known = READ_KEYS | INERT_KEYS | set(FIXED_KEYS)
    check_unquantized(hf, name)
    if hf["model_type"] == "gpt_oss":
        known |= GPT_OSS_KEYS
    elif hf["model_type"] == "llama4_text":
        known |= LLAMA4_KEYS
    elif hf["model_type"] == "gemma4_text":
        known = (known | GEMMA4_KEYS) - GEMMA4_UNREAD
    elif FAMILIES[hf["model_type"]].experts:
        known |= MOE_KEYS
    unknown = sorted(k for k in hf if k not in known)
    fixed = sorted(f"{k}={hf[k]!r}" for k in FIXED_KEYS if hf.get(k, FIXED_KEYS[k][0])
                   not in FIXED_KEYS[k] + GEMMA4_FIXED.get(k, ()) * (hf["model_type"] ==
                                                                    "gemma4_text"))
    if unknown or fixed:
        raise ConfigError(
            f"model {name!r}: config.json has " + "; ".join(
                [f"keys the kit's decoder does not build: {unknown}"] * bool(unknown)
                + [f"settings it builds only at their defaults: {fixed}"] * bool(fixed))
            + ". The kit refuses rather than run a different model from the one given.")


def layer_types(hf: dict, family: str, name: str) -> tuple:
    """Each layer's attention kind: config.json's `layer_types`, else what the family's
    config class derives (Gemma 2 alternates from a sliding first layer, Gemma 3 has every
    `sliding_window_pattern`-th layer full, Qwen's windows start at `max_window_layers`,
    Mistral's and Mixtral's `sliding_window` covers every layer, Qwen3-MoE's too once
    `use_sliding_window` is set)."""
    n, window = hf["num_hidden_layers"], hf.get("sliding_window")
    kinds = hf.get("layer_types")
    if kinds is None and family == "gemma2":
        kinds = [SLIDING if (i + 1) % 2 else FULL for i in range(n)]
    elif kinds is None and family == "gpt_oss":  # its class slides on every other layer
        kinds = [SLIDING if (i + 1) % 2 else FULL for i in range(n)]
    elif kinds is None and family == "gemma3_text":
        pattern = hf.get("sliding_window_pattern") or 6
        kinds = [SLIDING if (i + 1) % pattern else FULL for i in range(n)]
    elif kinds is None and family == "qwen3_moe":  # its class drops the window unless switched on
        kinds = [SLIDING if hf.get("use_sliding_window") and window else FULL] * n
    elif kinds is None and family in ("qwen2", "qwen3"):
        first = hf.get("max_window_layers", n) if hf.get("use_sliding_window") and window else n
        kinds = [SLIDING if i >= first else FULL for i in range(n)]
    elif kinds is None:
        kinds = [SLIDING if window else FULL] * n
    kinds = tuple(kinds)
    if len(kinds) != n or set(kinds) - {FULL, SLIDING}:
        raise ConfigError(f"model {name!r}: layer_types must name {FULL!r} or {SLIDING!r} for "
                          f"each of the {n} layers; it has {list(kinds)}")
    if SLIDING in kinds and not (isinstance(window, int) and window > 0):
        raise ConfigError(f"model {name!r}: sliding layers need a positive whole "
                          f"sliding_window; config.json has {window!r}")
    return kinds


def mlp_kinds(hf: dict, family: str, name: str) -> tuple:
    """Each layer's MLP, "experts" or "dense" ((): every layer dense): Qwen3-MoE routes every
    `decoder_sparse_step`-th layer except its `mlp_only_layers`, Mixtral every layer."""
    if not FAMILIES[family].experts:
        return ()
    n, step = hf["num_hidden_layers"], hf.get("decoder_sparse_step") or 1
    dense = set(hf.get("mlp_only_layers") or ())
    if not isinstance(step, int) or step < 1 or not dense <= set(range(n)):
        raise ConfigError(f"model {name!r}: decoder_sparse_step must be a positive whole number "
                          f"and mlp_only_layers layer indices below {n}; config.json has "
                          f"{step!r} and {sorted(dense)!r}")
    return tuple("experts" if (i + 1) % step == 0 and i not in dense else "dense"
                 for i in range(n))


def experts_of(hf: dict, family: str, name: str) -> dict:
    """The experts' sizes as `ModelConfig` holds them ({} for a dense family): how many, how
    many a token picks, each one's intermediate size (Mixtral's is `intermediate_size`) and
    whether the picked probabilities are renormalised."""
    if not FAMILIES[family].experts:
        return {}
    num = hf.get("num_experts") or hf.get("num_local_experts")
    top_k = hf.get("num_experts_per_tok")
    size = hf.get("moe_intermediate_size") or hf["intermediate_size"]
    if not all(isinstance(v, int) and v > 0 for v in (num, top_k, size)) or top_k > num:
        raise ConfigError(f"model {name!r}: a mixture of experts needs positive whole "
                          f"num_experts (or num_local_experts), num_experts_per_tok no larger, "
                          f"and an intermediate size; config.json has {num!r}, {top_k!r}, "
                          f"{size!r}")
    if family == "gpt_oss" and hf.get("experts_per_token", top_k) != top_k:
        raise ConfigError(f"model {name!r}: experts_per_token={hf['experts_per_token']!r} "
                          f"differs from num_experts_per_tok={top_k!r} (what transformers and "
                          "vLLM read; the published configs carry both, equal)")
    # gpt-oss's softmax over the k picked logits sums to 1, as a renormalised top k does
    return {"num_experts": num, "num_experts_per_tok": top_k, "moe_intermediate_size": size,
            "norm_topk_prob": family in ("mixtral", "gpt_oss") or bool(hf.get("norm_topk_prob")),
            **({"swiglu_alpha": hf["swiglu_alpha"], "swiglu_limit": hf["swiglu_limit"]}
               if FAMILIES[family].expert_act == "clamped_swiglu" else {})}
