"""Llama 4's text decoder (`llama4_text`) read from its config.json, as transformers 5.19's
`Llama4TextConfig` and vLLM 0.32's `vllm/model_executor/models/llama4.py` read it. Plain data
and checks: no torch.

    no_rope_layers             1: the layer rotates q and k (RoPE), 0: it does not (NoPE); from
                               `no_rope_layer_interval` when absent (every 4th layer NoPE)
    attention_chunk_size       RoPE layers attend within chunks of this many positions
                               ("chunked_attention"); NoPE layers attend to every position
    use_qk_norm                q and k of the RoPE layers RMS-normed, no weight, after RoPE
    attn_temperature_tuning    NoPE layers' queries scaled by 1 + attn_scale · ln(1 +
                               floor((position + 1) / floor_scale)): 1 below floor_scale - 1
    interleave_moe_layer_step  every step-th layer is an MoE layer, the others dense MLPs of
                               `intermediate_size_mlp`; each MoE layer adds a shared expert
                               (a dense MLP of `intermediate_size`, the experts' width)

Where the two read a key differently, the kit refuses the values on which they would disagree:
vLLM derives the chunked layers from `no_rope_layers` and the MoE layers from the step alone,
and its MLPs and shared expert are SiLU without biases, whatever `layer_types`, `moe_layers`,
`hidden_act` or `attention_bias` say. vLLM also replaces `attn_temperature_tuning` by its
generation config's, else by max_model_len > 32,768 (`Llama4ForCausalLM.__init__`); the kit
reads config.json's, as transformers does (the two agree below floor_scale - 1 positions).
"""
from __future__ import annotations

from kit.config.families import CHUNKED, FULL
from kit.errors import ConfigError


def positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def rope_layers(hf: dict, name: str) -> tuple[int, ...]:
    """Each layer's `no_rope_layers` entry (1: RoPE), as Llama4TextConfig derives it."""
    n, interval = hf["num_hidden_layers"], hf["no_rope_layer_interval"]
    given = hf.get("no_rope_layers")
    if not given:
        if not positive_int(interval):
            raise ConfigError(f"model {name!r}: no_rope_layer_interval must be a positive whole "
                              f"number; config.json has {interval!r}")
        return tuple(int((i + 1) % interval != 0) for i in range(n))
    if len(given) < n or set(given) - {0, 1}:
        raise ConfigError(f"model {name!r}: no_rope_layers must give 1 (RoPE) or 0 (NoPE) for "
                          f"each of the {n} layers; config.json has {given!r}")
    return tuple(given[:n])


def moe_layer_step(hf: dict, name: str) -> int:
    """`interleave_moe_layer_step`, with `moe_layers` (which vLLM does not read) checked
    against the layers it gives."""
    n, step = hf["num_hidden_layers"], hf["interleave_moe_layer_step"]
    if not positive_int(step):
        raise ConfigError(f"model {name!r}: interleave_moe_layer_step must be a positive whole "
                          f"number; config.json has {step!r}")
    given = hf.get("moe_layers")
    if given is not None and list(given) != list(range(step - 1, n, step)):
        raise ConfigError(f"model {name!r}: moe_layers {list(given)} differ from every "
                          f"interleave_moe_layer_step={step}-th layer, the layers vLLM makes "
                          "MoE layers (it reads only the step)")
    return step


def llama4_fields(hf: dict, name: str) -> dict:
    """`ModelConfig`'s fields that Llama 4's keys set (hf with Llama4TextConfig's defaults)."""
    rope = rope_layers(hf, name)
    kinds = tuple(CHUNKED if r else FULL for r in rope)
    if hf.get("layer_types") is not None and tuple(hf["layer_types"]) != kinds:
        raise ConfigError(f"model {name!r}: layer_types {hf['layer_types']} differ from "
                          f"no_rope_layers' ({list(kinds)}: chunked where RoPE), which vLLM "
                          "follows")
    chunk = hf["attention_chunk_size"]
    if not positive_int(chunk):
        raise ConfigError(f"model {name!r}: attention_chunk_size must be a positive whole "
                          f"number (transformers' chunked mask needs one); config.json has "
                          f"{chunk!r}")
    act = hf.get("hidden_act", "silu")
    if act != "silu" or hf.get("attention_bias"):
        raise ConfigError(f"model {name!r}: vLLM builds Llama 4 with SiLU MLPs and no attention "
                          f"biases; config.json has hidden_act={act!r}, "
                          f"attention_bias={hf.get('attention_bias')!r}")
    step = moe_layer_step(hf, name)
    tuning = bool(hf["attn_temperature_tuning"])
    return {"layer_types": kinds, "attention_chunk_size": chunk,
            "nope_layers": tuple(i for i, r in enumerate(rope) if not r),
            "qk_l2_norm": bool(hf["use_qk_norm"]),
            "floor_scale": hf["floor_scale"] if tuning else None,
            "attn_scale": hf["attn_scale"] if tuning else None,
            "mlp_kinds": tuple("experts" if (i + 1) % step == 0 else "dense"
                               for i in range(hf["num_hidden_layers"])),
            "intermediate_size_mlp": hf["intermediate_size_mlp"],
            "shared_expert_intermediate_size": hf["intermediate_size"]}


def llama4_keys(arch) -> dict:
    """config.json's Llama 4 keys for a `ModelConfig` of the family (`hf_dict`)."""
    n = arch.num_hidden_layers
    moe = [i for i in range(n) if arch.is_moe(i)]
    step = moe[0] + 1 if moe else n + 1
    if moe != list(range(step - 1, n, step)):
        raise ConfigError(f"model {arch.name!r}: Llama 4's MoE layers are every k-th; "
                          f"{moe} are not")
    tuning = arch.floor_scale is not None
    return {"num_local_experts": arch.num_experts, "num_experts_per_tok":
            arch.num_experts_per_tok, "interleave_moe_layer_step": step,
            "intermediate_size_mlp": arch.intermediate_size_mlp,
            "no_rope_layers": [int(i not in arch.nope_layers) for i in range(n)],
            "attention_chunk_size": arch.attention_chunk_size, "use_qk_norm": arch.qk_l2_norm,
            "attn_temperature_tuning": tuning, "attention_bias": False,
            **({"floor_scale": arch.floor_scale, "attn_scale": arch.attn_scale}
               if tuning else {})}
