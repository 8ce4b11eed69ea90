"""One validated configuration: the model's architecture and the run's settings (the bottom layer).

Every chapter builds a `Settings` with `load(preset, **overrides)` (in a notebook,
`notebook_settings(globals())` right after the parameters cell) and passes it down. Names
follow vLLM's (`max_num_batched_tokens`, `max_num_seqs`, `gpu_memory_utilization`, ...), so a
learner can move between the kit and the engine. Validation happens here, before any heavy
work, and every error says what to change. The vocabularies the settings draw on (dtypes and
their tolerances, KV cache dtypes, strategies) live here too, so validating imports no other
module of the kit, and torch only to ask whether CUDA is present.
"""
from __future__ import annotations

import json

from dataclasses import asdict, dataclass, fields
from pathlib import Path

from kit.errors import ConfigError
from kit.units import Bytes, Count, Fraction, parse_bytes

DATA = Path(__file__).resolve().parent.parent / "data"
MODELS_DIR = DATA / "models"
PRESETS_DIR = DATA / "presets"
DEFAULT_PRESET = "cpu-small"

# Where a decoder layer's norms sit (`Parts.layer`) -> their names in checkpoints.
LAYER_NORMS = {
    "pre_norm": ("input_layernorm", "post_attention_layernorm"),  # before attention, before MLP
    # Gemma 2 and 3: around attention and around the MLP, each output normed before it is added
    "sandwich": ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                 "post_feedforward_layernorm"),
}
# A layer's attention kind, as config.json's `layer_types` names it: a full layer attends to
# every earlier position, a sliding one to the last `sliding_window` (itself included).
FULL, SLIDING = "full_attention", "sliding_attention"


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
}
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
}
# Gemma 3's RoPE bases when config.json gives neither `rope_theta` nor `rope_parameters`
GEMMA3_ROPE = {"rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0}


def with_family_defaults(hf: dict, family: str) -> dict:
    """`hf` with its family's transformers defaults for the keys it leaves out."""
    defaults = dict(CONFIG_DEFAULTS.get(family, {}))
    if family == "gemma3_text" and "rope_parameters" not in hf:
        defaults.update(GEMMA3_ROPE)
    return {**defaults, **hf}


# Kinds of model the decoder does not build, refused before any work by what they need.
OUT_OF_REACH = {
    "multi-head latent attention": ("deepseek_v2", "deepseek_v3", "kimi_k2", "minicpm3"),
    "mixture of experts": ("mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss", "dbrx", "olmoe",
                           "granitemoe", "llama4", "llama4_text", "jamba"),
    "state-space or linear-attention layers": ("mamba", "mamba2", "qwen3_next", "falcon_h1",
                                               "bamba", "nemotron_h", "zamba2", "lfm2"),
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

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
# Largest difference allowed between two computations of the same logits or outputs (paged
# against no-cache, compiled against eager), relative to the reference's largest magnitude: a
# few units in the last place of the dtype, grown through the layers (compiled code fuses and
# reorders the arithmetic; a paged step rounds one token at a time). The README gives the
# errors seen.
TOLERANCE = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 4e-2}
# vLLM's kv_cache_dtype names -> bytes per element; "auto" means the model's dtype.
KV_CACHE_DTYPES = {"auto": None, "bfloat16": 2, "float16": 2, "float32": 4, "fp8": 1,
                   "fp8_e4m3": 1, "fp8_e5m2": 1}
# Ways to run the model's step (kit.engine.runners); the `strategies` setting names some.
STRATEGIES = ("eager", "stock", "guard_free", "bytecode_hook", "cuda_graphs")
DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32",
                 "float": "float32"}
ACTIVATIONS = {"silu", "gelu", "gelu_pytorch_tanh", "gelu_new"}


def known_names(folder: Path) -> list[str]:
    return sorted(p.stem for p in folder.glob("*.json"))


@dataclass(frozen=True)
class ModelConfig:
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
    rope_scaling: tuple = ()       # Llama 3's RoPE scaling as (key, value) pairs; () for none
    layer_types: tuple = ()        # each layer's attention kind (FULL or SLIDING); (): all full
    sliding_window: int | None = None          # positions a SLIDING layer sees
    rope_local_base_freq: float | None = None  # RoPE base of SLIDING layers (Gemma 3); None: same
    query_pre_attn_scalar: float | None = None  # scores scaled by its -1/2 power; None: head_dim
    attn_logit_softcapping: float | None = None  # scores become cap·tanh(scores / cap) (Gemma 2)
    final_logit_softcapping: float | None = None  # the same on the logits

    @classmethod
    def from_dict(cls, hf: dict, name: str, checkpoint: str | None = None) -> "ModelConfig":
        family = hf.get("model_type")
        check_family(family, name)
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
        kinds = layer_types(hf, family, name)
        theta, local_theta, scaling = rope(hf, name)
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
        )

    @classmethod
    def load(cls, model: str) -> "ModelConfig":
        """`model` is a preset name (a file under data/models/), a path to a config.json
        (random weights), or a checkpoint folder: its config.json, and its weights when it
        holds `*.safetensors` (see `checkpoint_files`)."""
        path, checkpoint = Path(model), None
        if path.is_dir():
            if not (path / "config.json").is_file():
                raise ConfigError(f"model folder {model!r} holds no config.json; a checkpoint "
                                  "folder needs config.json beside its *.safetensors")
            checkpoint = str(path.resolve()) if checkpoint_files(path) else None
            path = path / "config.json"
        if not path.is_file():
            path = MODELS_DIR / f"{model}.json"
        if not path.is_file():
            raise ConfigError(f"unknown model {model!r}: give one of {known_names(MODELS_DIR)} "
                              "or the path of a Hugging Face style config.json")
        name = path.parent.name if path.name == "config.json" else path.stem
        return cls.from_dict(json.loads(path.read_text()), name, checkpoint)

    @property
    def parts(self) -> Parts:
        """What the decoder is built from (`FAMILIES`)."""
        return FAMILIES[self.family]

    def attention_kind(self, layer: int) -> str:
        """FULL or SLIDING: what layer `layer` attends to."""
        return self.layer_types[layer] if self.layer_types else FULL

    def window(self, layer: int) -> int | None:
        """Positions layer `layer` sees (the newest included); None: all of them."""
        return self.sliding_window if self.attention_kind(layer) == SLIDING else None

    def layer_rope_theta(self, layer: int) -> float:
        """The RoPE base of layer `layer` (Gemma 3's sliding layers have their own)."""
        return self.rope_local_base_freq or self.rope_theta if self.window(layer) \
            else self.rope_theta

    @property
    def attention_scale(self) -> float:
        """What the scores q·k are multiplied by before the softmax."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def layer_weights(self) -> int:
        """Elements of one layer's matrices: the Q, K, V and O projections and the MLP's three."""
        h, q, kv = self.hidden_size, self.num_attention_heads * self.head_dim, \
            self.num_key_value_heads * self.head_dim
        return h * q + 2 * h * kv + q * h + 3 * h * self.intermediate_size

    def linear_weights(self) -> int:
        """Elements of every matrix a token is multiplied by: every layer's, and the LM head
        (the embedding table itself when tied)."""
        return self.num_hidden_layers * self.layer_weights() + self.vocab_size * self.hidden_size

    def num_parameters(self) -> int:
        """Parameter count from the shapes alone (the model's real count must equal it): the
        matrices, the attention biases, every norm, and the input embedding when untied."""
        h = self.hidden_size
        bias = (self.num_attention_heads + 2 * self.num_key_value_heads) * self.head_dim \
            if self.attention_bias else 0
        embed = 0 if self.tie_word_embeddings else self.vocab_size * h
        norms = len(self.parts.layer_norms) * h + 2 * self.head_dim * self.parts.qk_norm
        return self.linear_weights() + embed + self.num_hidden_layers * (bias + norms) + h

    def hf_dict(self) -> dict:
        """The config.json that vLLM or transformers would read for this architecture."""
        return {
            "architectures": [self.parts.architecture], "model_type": self.family,
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
            "vocab_size": self.vocab_size, "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta,
            "hidden_act": self.hidden_act, "tie_word_embeddings": self.tie_word_embeddings,
            "torch_dtype": self.torch_dtype,
            **({"rope_scaling": {"rope_type": "llama3", **dict(self.rope_scaling)}}
               if self.rope_scaling else {}),
            **self.attention_keys(),
        }

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
        if self.family == "mistral":  # its class holds no layer_types: every layer or none
            keys["sliding_window"] = self.sliding_window
        elif self.sliding_window:
            keys["sliding_window"] = self.sliding_window
            keys["layer_types"] = list(self.layer_types)
            if self.family in ("qwen2", "qwen3"):  # their configs' own switch for windows
                keys["use_sliding_window"] = True
                keys["max_window_layers"] = self.layer_types.index(SLIDING)
        if self.rope_local_base_freq:
            keys["rope_local_base_freq"] = self.rope_local_base_freq
        return keys


def check_family(family, name: str) -> None:
    """A model_type the decoder builds; kinds it cannot build refused by what they need."""
    if family in FAMILIES:
        return
    need = next((what for what, types in OUT_OF_REACH.items() if family in types), None)
    raise ConfigError(
        f"model {name!r}: model_type {family!r} is not supported"
        f"{f' (it needs {need}, which the kit does not build)' if need else ''}; the kit's "
        f"decoder covers {sorted(FAMILIES)}: RMSNorm, RoPE, a gated MLP, grouped-query "
        "attention over full or sliding windows.")


def check_keys(hf: dict, name: str) -> None:
    """Every key of config.json is read, inert or at the one value the decoder builds; any
    other is refused by name (a key ignored would run a model the user did not give)."""
    unknown = sorted(k for k in hf if k not in READ_KEYS | INERT_KEYS | set(FIXED_KEYS))
    fixed = sorted(f"{k}={hf[k]!r}" for k in FIXED_KEYS if hf.get(k, FIXED_KEYS[k][0])
                   not in FIXED_KEYS[k])
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
    Mistral's `sliding_window` covers every layer)."""
    n, window = hf["num_hidden_layers"], hf.get("sliding_window")
    kinds = hf.get("layer_types")
    if kinds is None and family == "gemma2":
        kinds = [SLIDING if (i + 1) % 2 else FULL for i in range(n)]
    elif kinds is None and family == "gemma3_text":
        pattern = hf.get("sliding_window_pattern") or 6
        kinds = [SLIDING if (i + 1) % pattern else FULL for i in range(n)]
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


def rope(hf: dict, name: str) -> tuple[float, float | None, tuple]:
    """RoPE's base for full layers, for sliding ones (None: the same) and Llama 3's scaling.
    transformers 5 writes `rope_parameters`, one dict or one per attention kind (Gemma 3);
    4.x wrote `rope_theta`, `rope_local_base_freq` and `rope_scaling`."""
    params = hf.get("rope_parameters") or {}
    full, local = (params.get(FULL, {}), params.get(SLIDING, {})) if FULL in params \
        else (params, {})
    theta = hf.get("rope_theta") or full.get("rope_theta") or 10000.0
    local_theta = hf.get("rope_local_base_freq") or local.get("rope_theta")
    if local and (local.get("rope_type") or "default") != "default":
        raise ConfigError(f"model {name!r}: rope scaling {local.get('rope_type')!r} on sliding "
                          "layers is not supported")
    return theta, local_theta, rope_scaling(hf.get("rope_scaling") or full, name)


LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor",
                    "original_max_position_embeddings")


def rope_scaling(params: dict, name: str) -> tuple:
    """Llama 3's RoPE scaling (`rope_scaling`, or transformers 5's `rope_parameters`) as
    (key, value) pairs, () for none; every other kind refused, since ignoring it would give
    a real checkpoint wrong logits."""
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind == "default":
        return ()
    missing = [k for k in LLAMA3_ROPE_KEYS if k not in params]
    if kind != "llama3" or missing:
        raise ConfigError(f"model {name!r}: rope scaling {kind!r} "
                          f"{'lacks ' + str(missing) if kind == 'llama3' else 'is not supported'}"
                          "; the kit's RoPE covers none and Llama 3's ('llama3')")
    return tuple((k, params[k]) for k in LLAMA3_ROPE_KEYS)


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


def check_tensor_parallel(arch: ModelConfig, tensor_parallel_size: int) -> None:
    """vLLM shards attention heads evenly over the ranks."""
    if arch.num_attention_heads % tensor_parallel_size:
        raise ConfigError(f"tensor_parallel_size={tensor_parallel_size} does not divide "
                          f"{arch.name}'s num_attention_heads={arch.num_attention_heads}")


def check_kv_cache_dtype(name: str) -> None:
    if name not in KV_CACHE_DTYPES:
        raise ConfigError(f"kv_cache_dtype={name!r}: use one of {list(KV_CACHE_DTYPES)}")


def available_strategies(device: str) -> tuple[str, ...]:
    """The strategies that can run on `device` (CUDA graphs need a GPU)."""
    return tuple(s for s in STRATEGIES if s != "cuda_graphs" or device == "cuda")


def resolve_device(name: str) -> str:
    """`auto` -> "cuda" when PyTorch sees a CUDA device, else "cpu"; "cuda" without one is
    refused. Only these two ask torch (imported here, not when the kit is imported)."""
    if name not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"device={name!r}: use 'auto', 'cpu' or 'cuda'")
    if name == "cpu":
        return name
    import torch
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device='cuda' but this machine has no CUDA device "
                          f"(torch {torch.__version__}); use device='auto' or 'cpu', or the "
                          "cpu-small preset")
    return "cuda" if torch.cuda.is_available() else "cpu"


SETTING_QUANTITIES = {"device_memory": Bytes, "kv_cache_memory_bytes": Bytes,
                     "gpu_memory_utilization": Fraction}  # every other number a count


@dataclass(frozen=True)
class Settings:
    """The run's settings. Build it with `load()`; every chapter takes one."""
    # `arch` (the ModelConfig of `model`) is set by __post_init__; it is derived, not a field.

    preset: str
    model: str
    device: str
    dtype: str
    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    gpu_memory_utilization: float
    device_memory: int | None
    block_size: int
    kv_cache_dtype: str
    tensor_parallel_size: int
    kv_cache_memory_bytes: int | None
    batch_size: int
    input_len: int
    output_len: int
    seed: int
    strategies: tuple[str, ...] | None = None  # serving strategies to run; None: all that apply
    num_iters: int = 3  # timed runs of the whole generation per strategy (vLLM's benchmark name)
    description: str = ""

    def __post_init__(self):
        object.__setattr__(self, "device_memory", parse_bytes(self.device_memory))
        object.__setattr__(self, "kv_cache_memory_bytes", parse_bytes(self.kv_cache_memory_bytes))
        self._check_positive()
        if self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size={self.block_size} must be a power of two "
                              "(16 is vLLM's GPU default; its CPU backend takes multiples of 32)")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(f"gpu_memory_utilization={self.gpu_memory_utilization} must be in "
                              "(0, 1]: it is the fraction of device memory the engine may use")
        arch = ModelConfig.load(self.model)
        object.__setattr__(self, "arch", arch)
        if self.max_model_len > arch.max_position_embeddings:
            raise ConfigError(f"max_model_len={self.max_model_len} is beyond {arch.name}'s "
                              f"max_position_embeddings={arch.max_position_embeddings}; lower it")
        if self.input_len + self.output_len > self.max_model_len:
            raise ConfigError(f"input_len + output_len = {self.input_len + self.output_len} "
                              f"exceeds max_model_len={self.max_model_len}")
        check_tensor_parallel(arch, self.tensor_parallel_size)
        check_kv_cache_dtype(self.kv_cache_dtype)
        if self.batch_size > self.max_num_seqs:
            raise ConfigError(f"batch_size={self.batch_size} is above max_num_seqs="
                              f"{self.max_num_seqs}; raise max_num_seqs or lower batch_size")
        object.__setattr__(self, "dtype", self._resolve_dtype(arch))
        object.__setattr__(self, "device", resolve_device(self.device))
        object.__setattr__(self, "strategies", self._check_strategies())

    def _check_positive(self):
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len", "block_size",
                     "tensor_parallel_size", "batch_size", "input_len", "output_len",
                     "num_iters"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{name}={value!r} must be a positive whole number")
        for name in ("device_memory", "kv_cache_memory_bytes"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ConfigError(f"{name}={getattr(self, name)} must be positive")

    def _check_strategies(self) -> tuple[str, ...] | None:
        """None, a list or a comma-separated string of STRATEGIES, each one known and usable
        on this device."""
        if self.strategies is None:
            return None
        names = self.strategies.split(",") if isinstance(self.strategies, str) \
            else list(self.strategies)
        names = [n.strip() for n in names if n.strip()]
        unknown = [n for n in names if n not in STRATEGIES]
        if unknown or not names:
            what = f"unknown strategies {unknown}" if unknown else "no strategy named"
            raise ConfigError(f"strategies={self.strategies!r}: {what}; known: "
                              f"{list(STRATEGIES)} (or None for all that apply)")
        usable = available_strategies(self.device)
        unusable = [n for n in names if n not in usable]
        if unusable:
            raise ConfigError(f"strategies {unusable} cannot run on device={self.device!r}; "
                              f"here use any of {list(usable)}")
        return tuple(dict.fromkeys(names))

    def strategies_to_run(self) -> tuple[str, ...]:
        """The strategies set, or every one that runs on the device."""
        return self.strategies or available_strategies(self.device)

    def _resolve_dtype(self, arch: ModelConfig) -> str:
        dtype = arch.torch_dtype if self.dtype == "auto" else self.dtype
        dtype = DTYPE_ALIASES.get(dtype, dtype)
        if dtype not in DTYPE_BYTES:
            raise ConfigError(f"dtype={self.dtype!r}: use 'auto' or one of {sorted(DTYPE_BYTES)}")
        return dtype

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    def as_dict(self) -> dict:
        """The fields, numbers typed (`kit.units`): sizes in bytes, the utilization a fraction,
        the rest counts."""
        out = asdict(self)
        for name, value in out.items():
            kind = SETTING_QUANTITIES.get(name, Count)
            if name in SETTING_QUANTITIES or isinstance(value, int) and not isinstance(value, bool):
                out[name] = kind.of(value)
        return out


PARAMETERS = tuple(f.name for f in fields(Settings) if f.name not in ("preset", "description"))


def read_preset(preset: str) -> dict:
    path = PRESETS_DIR / f"{preset}.json"
    if not path.is_file():
        raise ConfigError(f"unknown preset {preset!r}: give one of {known_names(PRESETS_DIR)}")
    return json.loads(path.read_text())


def check_names(names) -> None:
    unknown = sorted(set(names) - set(PARAMETERS))
    if unknown:
        raise ConfigError(f"unknown parameter(s) {unknown}; known: {sorted(PARAMETERS)}")


def load(preset: str = DEFAULT_PRESET, **overrides) -> Settings:
    """Settings of `preset` with `overrides` applied; a value of None keeps the preset's."""
    check_names(overrides)
    values = read_preset(preset)
    values.update({k: v for k, v in overrides.items() if v is not None})
    return Settings(preset=preset, **values)


def notebook_settings(namespace: dict) -> Settings:
    """The settings of a notebook's parameters cell: `load(preset, **those parameters)`, read
    from `namespace` (the notebook's `globals()`, right after the parameters cell). A notebook
    declares the parameters it takes; each one's None keeps the preset's value."""
    params = {k: namespace[k] for k in PARAMETERS if k in namespace}
    return load(namespace.get("preset", DEFAULT_PRESET), **params)


def reference(name: str) -> dict:
    """Published numbers under data/reference/ shown beside measured ones: `pr7796` (vLLM pull request
    #7796, Gemma-2B on a GPU), `vllm_cpu` (vLLM's CPU engine as recorded), `mlp_probe` (the
    chapter 03 issue's tiny-MLP measurement)."""
    return json.loads((DATA / "reference" / f"{name}.json").read_text())
