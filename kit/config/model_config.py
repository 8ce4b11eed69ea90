"""The decoder's architecture, read from a Hugging Face style config.json (`ModelConfig`), and
the checkpoint folder's weight files beside it."""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from kit.config.cache_kinds import (DELTA_FAMILIES, LATENT_FAMILIES, LINEAR, MAMBA2_FAMILIES,
                                    MLP_ONLY, Recurrent, sized_only_fields)
from kit.config.data import MODELS_DIR, known_names
from kit.config.deepseek import DeepSeekRouting, deepseek_fields
from kit.config.families import (ACTIVATIONS, CHUNKED, FAMILIES, FULL, GEMMA4_UNREAD, SLIDING,
                                 Parts, check_family, check_keys, check_unquantized, experts_of,
                                 layer_types, mlp_kinds, with_family_defaults)
from kit.config.gemma4 import gemma4_fields, gemma4_keys
from kit.config.hub import hub_config, is_hub_id
from kit.config.hybrid import HybridScales, hybrid_fields
from kit.config.llama4 import llama4_fields, llama4_keys
from kit.config.qwen3_next import qwen3_next_fields
from kit.config.rope_params import rope
from kit.config.parameter_counts import ParameterCounts
from kit.errors import ConfigError


@dataclass(frozen=True)
class ModelConfig(ParameterCounts):
    """The decoder's architecture, read from a Hugging Face style config.json."""

    name: str
    family: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    hidden_act: str
    tie_word_embeddings: bool
    attention_bias: bool
    torch_dtype: str
    checkpoint: str | None = None  # a folder of safetensors weights to load; None: random
    rope_scaling: tuple = ()       # Llama 3's or YaRN's RoPE scaling as (key, value) pairs,
    #                                "rope_type" first; () for none
    layer_types: tuple = ()        # each layer's attention kind (FULL or SLIDING); (): all full
    sliding_window: int | None = None          # positions a SLIDING layer sees
    rope_local_base_freq: float | None = None  # RoPE base of SLIDING layers (Gemma 3); None: same
    query_pre_attn_scalar: float | None = None  # scores scaled by its -1/2 power; None: head_dim
    attn_logit_softcapping: float | None = None  # scores become cap·tanh(scores / cap) (Gemma 2)
    final_logit_softcapping: float | None = None  # the same on the logits
    mlp_kinds: tuple = ()          # each layer's MLP, "experts" or "dense"; (): every one dense
    num_experts: int = 0           # experts in each MoE layer (every one stays resident)
    num_experts_per_tok: int = 0   # experts each token is routed through (top k)
    moe_intermediate_size: int = 0  # one expert's intermediate size
    norm_topk_prob: bool = False   # the k picked probabilities renormalised to sum to 1
    swiglu_alpha: float | None = None  # gpt-oss's clamped SwiGLU: gate·σ(alpha·gate)·(up + 1),
    swiglu_limit: float | None = None  # gate clamped above at limit, up to ±limit
    # Llama 4 (`kit.config.llama4`): CHUNKED layers attend within chunks of this many positions
    attention_chunk_size: int | None = None
    nope_layers: tuple = ()        # layers without RoPE
    qk_l2_norm: bool = False       # q and k of the RoPE layers RMS-normed without a weight
    floor_scale: float | None = None  # NoPE layers' queries × 1 + attn_scale·ln(1 +
    attn_scale: float | None = None   # floor((pos + 1) / floor_scale)); None: not scaled
    intermediate_size_mlp: int | None = None  # the dense layers' width, where not intermediate_size
    shared_expert_intermediate_size: int = 0  # a shared expert's width on MoE layers; 0: none
    # Gemma 4 (kit.config.gemma4): full layers' head_dim and KV heads (None: the model's), the
    # last layers reading an earlier layer's cache, V = K's projection on full layers, the
    # per-layer embeddings' width (0: none) and table rows, the KV-shared layers' MLPs doubled
    global_head_dim: int | None = None
    num_global_key_value_heads: int | None = None
    num_kv_shared_layers: int = 0
    attention_k_eq_v: bool = False
    hidden_size_per_layer_input: int = 0
    vocab_size_per_layer_input: int = 0
    use_double_wide_mlp: bool = False
    # Caches that are not K and V per head (kit.config.cache_kinds; sized; DeepSeek-V2, V3 run):
    # latent attention's latent and rotary key per token (DeepSeek; the weights also read the
    # query's, the non-rotary key's and the value's head sizes), and the recurrent layers'
    # state (LINEAR in layer_types); `source_config`: the user's config.json, given to vLLM
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    q_lora_rank: int | None = None
    recurrent: Recurrent | None = None
    # their weights (kit.config.cache_kinds_counts): Qwen3-Next's query doubled into a gate of
    # the output, an expert's width where Nemotron-H projects to a latent around its experts
    # (0: hidden_size), a learned bias of each expert's routing score (vLLM's parameter)
    attn_output_gate: bool = False
    moe_latent_size: int = 0
    router_score_bias: bool = False
    source_config: str = ""
    deepseek: DeepSeekRouting | None = None  # DeepSeek's router and score factor
    partial_rotary_factor: float = 1.0  # the fraction of each head RoPE turns (Qwen3-Next)
    hybrid: HybridScales | None = None  # a Mamba-2 hybrid's factors (kit.config.hybrid)

    @classmethod
    def from_dict(cls, hf: dict, name: str, checkpoint: str | None = None) -> "ModelConfig":
        family = hf.get("model_type")
        check_family(family, name)
        if FAMILIES[family].sized_only:
            check_unquantized(hf, name)
            fields = sized_only_fields(hf, family, name)
            if family in LATENT_FAMILIES:
                fields.update(deepseek_fields(hf, name))
            elif family in DELTA_FAMILIES:
                fields.update(qwen3_next_fields(hf, name))
            elif family in MAMBA2_FAMILIES:
                fields.update(hybrid_fields(hf, family, name))
            return cls(name=name, family=family, checkpoint=checkpoint, **fields)
        check_keys(hf, name)
        hf = with_family_defaults(hf, family)
        missing = [k for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads", "vocab_size") if k not in hf]
        if missing:
            raise ConfigError(f"model {name!r}: config.json lacks {missing}")
        heads = hf["num_attention_heads"]
        kv_heads = hf.get("num_key_value_heads") or heads
        if heads % kv_heads:
            raise ConfigError(f"model {name!r}: num_attention_heads={heads} is not a multiple "
                              f"of num_key_value_heads={kv_heads}")
        act = hf.get("hidden_activation") or hf.get("hidden_act", "silu")
        if act == "gelu":
            act = FAMILIES[family].gelu
        if act not in ACTIVATIONS:
            raise ConfigError(f"model {name!r}: hidden_act {act!r} is not one of {sorted(ACTIVATIONS)}")
        own = own_fields(hf, family, name)
        kinds = own.pop("layer_types", None) or layer_types(hf, family, name)
        theta, local_theta, scaling = (own.pop("rope_theta"), own.pop("rope_local_base_freq"),
                                       own.pop("rope_scaling")) if "rope_theta" in own \
            else rope(hf, name)
        moe = {"mlp_kinds": own.pop("mlp_kinds", ())} if FAMILIES[family].gemma4 else {
            "mlp_kinds": own.pop("mlp_kinds", None) or mlp_kinds(hf, family, name),
            **experts_of(hf, family, name)}
        return cls(
            name=name, family=family,
            hidden_size=hf["hidden_size"], intermediate_size=hf["intermediate_size"],
            num_hidden_layers=hf["num_hidden_layers"], num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            vocab_size=hf["vocab_size"],
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6), rope_theta=theta,
            hidden_act=act, tie_word_embeddings=hf.get("tie_word_embeddings",
                                                          FAMILIES[family].tie_word_embeddings),
            attention_bias=hf.get("attention_bias", FAMILIES[family].attention_bias),
            # transformers 5 writes `dtype` and `rope_parameters` where 4.x wrote
            # `torch_dtype` and `rope_theta`
            torch_dtype=hf.get("torch_dtype") or hf.get("dtype") or "bfloat16",
            checkpoint=checkpoint, rope_scaling=scaling, layer_types=kinds,
            sliding_window=hf.get("sliding_window") if SLIDING in kinds else None,
            rope_local_base_freq=local_theta if SLIDING in kinds else None,
            query_pre_attn_scalar=hf.get("query_pre_attn_scalar"),
            attn_logit_softcapping=hf.get("attn_logit_softcapping"),
            final_logit_softcapping=hf.get("final_logit_softcapping"),
            **moe, **own,
        )

    @classmethod
    def load(cls, model: str) -> "ModelConfig":
        """`model` is a preset name (a file under data/models/), a path to a config.json
        (random weights), a checkpoint folder (its config.json, and its weights when it holds
        `*.safetensors`: see `checkpoint_files`), or a Hugging Face id such as
        `Qwen/Qwen3-0.6B` (its config.json alone, through the Hub's cache: `hub_config`;
        random weights). A local path wins over an id of the same spelling."""
        path, checkpoint = Path(model), None
        if is_hub_id(model) and not path.exists():
            hf = json.loads(hub_config(model, f"instead give {local_models()}").read_text())
            return cls.from_dict(hf, model)
        if path.is_dir():
            if not (path / "config.json").is_file():
                raise ConfigError(f"model folder {model!r} holds no config.json; a checkpoint "
                                  "folder needs config.json beside its *.safetensors")
            checkpoint = str(path.resolve()) if checkpoint_files(path) else None
            path = path / "config.json"
        if not path.is_file():
            path = MODELS_DIR / f"{model}.json"
        if not path.is_file():
            raise ConfigError(f"unknown model {model!r}: give {local_models()}, or a Hugging Face "
                              "id such as Qwen/Qwen3-0.6B")
        name = path.parent.name if path.name == "config.json" else path.stem
        return cls.from_dict(json.loads(path.read_text()), name, checkpoint)

    @property
    def parts(self) -> Parts:
        """What the decoder is built from (`FAMILIES`)."""
        return FAMILIES[self.family]

    def attention_kind(self, layer: int) -> str:
        """FULL, SLIDING or CHUNKED: what layer `layer` attends to; LINEAR for a recurrent
        layer and MLP_ONLY for a layer without a mixer (Nemotron-H)."""
        return self.layer_types[layer] if self.layer_types else FULL

    def chunk(self, layer: int) -> int | None:
        """The chunk layer `layer` attends within (Llama 4's CHUNKED layers); None: none."""
        return self.attention_chunk_size if self.attention_kind(layer) == CHUNKED else None

    def uses_rope(self, layer: int) -> bool:
        """Whether layer `layer` rotates its queries and keys (Llama 4's NoPE layers do not)."""
        return layer not in self.nope_layers

    def window(self, layer: int) -> int | None:
        """Positions layer `layer` sees (the newest included); None: all of them."""
        return self.sliding_window if self.attention_kind(layer) == SLIDING else None

    def layer_rope_theta(self, layer: int) -> float:
        """The RoPE base of layer `layer` (Gemma 3's sliding layers have their own)."""
        return self.rope_local_base_freq or self.rope_theta if self.window(layer) \
            else self.rope_theta

    @property
    def attention_scale(self) -> float:
        """What the scores q·k are multiplied by before the softmax (1 for Gemma 4, whose Q
        and K norms set the scale)."""
        if self.parts.unscaled_scores:
            return 1.0
        if self.hybrid and self.hybrid.attention_multiplier is not None:  # Granite's
            return self.hybrid.attention_multiplier
        factor = self.deepseek.score_factor if self.deepseek else 1.0  # YaRN's mscale²
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5 * factor

    @property
    def dense_intermediate_size(self) -> int:
        """A dense layer's MLP width (Llama 4's `intermediate_size_mlp`, else
        intermediate_size)."""
        return self.intermediate_size_mlp or self.intermediate_size

    def layer_head_dim(self, layer: int) -> int:
        """Layer `layer`'s head size (Gemma 4's full layers have their own)."""
        return self.global_head_dim if self.global_head_dim and \
            self.attention_kind(layer) == FULL else self.head_dim

    def layer_kv_heads(self, layer: int) -> int:
        """Layer `layer`'s KV heads (Gemma 4's full layers may have their own)."""
        return self.num_global_key_value_heads if self.num_global_key_value_heads and \
            self.attention_kind(layer) == FULL else self.num_key_value_heads

    def kv_source(self, layer: int) -> int:
        """The layer whose keys and values layer `layer` attends to: itself, or for Gemma 4's
        last num_kv_shared_layers the last earlier layer of its kind (vLLM's
        `kv_sharing_target_layer_name`)."""
        first = self.num_hidden_layers - self.num_kv_shared_layers
        if layer < first:
            return layer
        kind = self.attention_kind(layer)
        sources = [i for i in range(first) if self.attention_kind(i) == kind]
        if not sources:  # (a layer pattern changed after reading, `with_layer_pattern`)
            raise ConfigError(f"model {self.name!r}: KV-shared layer {layer} ({kind}) has no "
                              f"earlier {kind} layer among the first {first} to read from")
        return sources[-1]

    def has_kv_cache(self, layer: int) -> bool:
        """Whether layer `layer` keeps a cache of its own (a KV cache spec): keys and values,
        a latent or a recurrent state; not an MLP-only layer, nor one reading another's."""
        return self.attention_kind(layer) != MLP_ONLY and self.kv_source(layer) == layer

    def is_recurrent(self, layer: int) -> bool:
        """Whether layer `layer` keeps a recurrent state (Mamba-2, a gated delta-net)."""
        return self.attention_kind(layer) == LINEAR

    @property
    def latent_size(self) -> int:
        """What a latent attention layer keeps per token: kv_lora_rank + qk_rope_head_dim
        elements (0: the layers keep keys and values per head)."""
        return self.kv_lora_rank + self.qk_rope_head_dim if self.kv_lora_rank else 0

    def has_v_proj(self, layer: int) -> bool:
        """Whether layer `layer` projects V (Gemma 4's attention_k_eq_v full layers reuse K's)."""
        return self.has_kv_cache(layer) and not (
            self.attention_k_eq_v and self.attention_kind(layer) == FULL)

    def layer_intermediate_size(self, layer: int) -> int:
        """Layer `layer`'s dense MLP width (Llama 4's `intermediate_size_mlp`; Gemma 4's
        use_double_wide_mlp doubles the KV-shared layers')."""
        wide = self.use_double_wide_mlp and not self.has_kv_cache(layer)
        return self.dense_intermediate_size * (2 if wide else 1)

    def is_moe(self, layer: int) -> bool:
        """Whether layer `layer`'s MLP routes each token through experts."""
        return bool(self.mlp_kinds) and self.mlp_kinds[layer] == "experts"

    def hf_dict(self) -> dict:
        """The config.json that vLLM or transformers would read for this architecture (Gemma
        4's RoPE in `rope_parameters` alone: `gemma4_keys`; a family sized only: the user's)."""
        if self.source_config:
            return json.loads(self.source_config)
        keys = {
            "architectures": [self.parts.architecture], "model_type": self.family,
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
            "vocab_size": self.vocab_size, "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta,
            "hidden_act": self.hidden_act, "tie_word_embeddings": self.tie_word_embeddings,
            "torch_dtype": self.torch_dtype,
            **({"rope_scaling": dict(self.rope_scaling)} if self.rope_scaling
               else {"rope_scaling": {"rope_type": "default"}} if self.family == "gpt_oss"
               else {}),
            **self.attention_keys(), **self.experts_keys(),
        }
        if self.parts.gemma4:
            keys = {k: v for k, v in keys.items() if k not in GEMMA4_UNREAD}
            keys.update(gemma4_keys(self))
        return keys

    def experts_keys(self) -> dict:
        """config.json's keys for the experts, as the family's published configs write them
        (Gemma 4's: `gemma4_keys`)."""
        if not self.num_experts or self.parts.gemma4:
            return {}
        keys = {"num_experts_per_tok": self.num_experts_per_tok}
        if self.family == "llama4_text":
            return llama4_keys(self)
        if self.family == "mixtral":
            return {**keys, "num_local_experts": self.num_experts}
        if self.family == "gpt_oss":
            return {**keys, "num_local_experts": self.num_experts, "attention_bias":
                    self.attention_bias, "swiglu_alpha": self.swiglu_alpha,
                    "swiglu_limit": self.swiglu_limit}
        dense = [i for i in range(self.num_hidden_layers) if not self.is_moe(i)]
        return {**keys, "num_experts": self.num_experts, "norm_topk_prob": self.norm_topk_prob,
                "moe_intermediate_size": self.moe_intermediate_size,
                "decoder_sparse_step": 1, "mlp_only_layers": dense}

    def attention_keys(self) -> dict:
        """config.json's keys for what sets attention apart from plain causal attention, as
        the family's published configs write them (vLLM and transformers read these). Where a
        family's config class has a default of its own (Gemma 2's caps and 256 for
        query_pre_attn_scalar, Mistral's window of 4096, Gemma 3's local RoPE base of 10000),
        the key is written even when unset (null), so that both read the kit's model."""
        keys = {k: getattr(self, k) for k in ("query_pre_attn_scalar", "attn_logit_softcapping",
                                               "final_logit_softcapping") if getattr(self, k)}
        if self.family.startswith("gemma"):  # Gemma's classes read hidden_activation
            keys["hidden_activation"] = self.hidden_act
        if self.family in ("gemma2", "gemma3_text"):
            keys.update(query_pre_attn_scalar=self.query_pre_attn_scalar or self.head_dim,
                        attn_logit_softcapping=self.attn_logit_softcapping,
                        final_logit_softcapping=self.final_logit_softcapping,
                        sliding_window=self.sliding_window, layer_types=list(self.layer_types))
        if self.family == "gemma3_text":
            keys["rope_local_base_freq"] = self.rope_local_base_freq or self.rope_theta
        if self.family in ("mistral", "mixtral"):  # no layer_types: every layer or none
            keys["sliding_window"] = self.sliding_window
        elif self.family == "gpt_oss":  # its class would slide every other layer over 128
            keys["sliding_window"] = self.sliding_window
            keys["layer_types"] = [self.attention_kind(i) for i in range(self.num_hidden_layers)]
        elif self.sliding_window:
            keys["sliding_window"] = self.sliding_window
            keys["layer_types"] = list(self.layer_types)
            if self.family == "qwen3_moe":  # every layer slides once switched on
                keys["use_sliding_window"] = True
                del keys["layer_types"]
            elif self.family in ("qwen2", "qwen3"):  # their configs' own switch for windows
                keys["use_sliding_window"] = True
                keys["max_window_layers"] = self.layer_types.index(SLIDING)
        if self.rope_local_base_freq:
            keys["rope_local_base_freq"] = self.rope_local_base_freq
        return keys



def own_fields(hf: dict, family: str, name: str) -> dict:
    """The fields a family reads with its own module (Llama 4's, Gemma 4's); {} for others."""
    if family == "llama4_text":
        return llama4_fields(hf, name)
    return gemma4_fields(hf, name) if FAMILIES[family].gemma4 else {}


def local_models() -> str:
    """The local ways to give a model, for the messages that refuse one."""
    return (f"one of {known_names(MODELS_DIR)} (data/models/), or the path of a Hugging Face "
            "style config.json or of a model folder")


PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")


def checkpoint_files(folder: Path) -> list[Path]:
    """The safetensors files of a checkpoint folder: the shards its model.safetensors.index.json
    names, else model.safetensors, else every *.safetensors; [] when it holds no weights
    (config.json alone). Pickle weights are refused: loading them runs code from the file."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, AttributeError) as e:
            raise ConfigError(f"{index} is not an index of shards (a JSON object with a "
                              f"weight_map): {e!r}") from None
        missing = [n for n in names if not (folder / n).is_file()]
        if missing:
            raise ConfigError(f"{index} names shards that are not in the folder: {missing}")
        return [folder / n for n in names]
    if (folder / "model.safetensors").is_file():  # beside it may sit other formats' files
        return [folder / "model.safetensors"]  # (Mistral's consolidated.safetensors)
    files = sorted(folder.glob("*.safetensors"))
    pickles = sorted(p.name for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if not files and pickles:
        raise ConfigError(
            f"model folder {str(folder)!r} holds only pickle weights {pickles}; the kit reads "
            "safetensors only (a pickle runs code when loaded). Convert them once, where you "
            "trust the files: AutoModelForCausalLM.from_pretrained(folder)"
            ".save_pretrained(new_folder) writes model.safetensors (transformers' default).")
    return files


def with_layer_pattern(arch: ModelConfig, full_every: int | None,
                       sliding_window: int | None = None) -> ModelConfig:
    """`arch` with every `full_every`-th layer full attention and the others sliding over
    `sliding_window` tokens (its own window when None); `full_every` 0 keeps its layers."""
    if full_every == 0:
        return arch
    if arch.parts.sized_only:
        raise ConfigError(f"model {arch.name!r}: its layers are not all attention "
                          f"({arch.family}); a layer pattern applies to attention layers only")
    window = sliding_window or arch.sliding_window or 4096
    kinds = tuple(FULL if full_every and (i + 1) % full_every == 0 else SLIDING
                  for i in range(arch.num_hidden_layers))
    if SLIDING not in kinds:
        return replace(arch, layer_types=(), sliding_window=None)
    return replace(arch, layer_types=kinds, sliding_window=window)
