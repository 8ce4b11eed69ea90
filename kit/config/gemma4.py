"""Gemma 4's text decoder (`gemma4_text`) read from config.json: what it adds to Gemma 3, as
transformers 5.19's `Gemma4TextConfig` (models/gemma4/configuration_gemma4.py) derives it and
vLLM 0.32 (vllm/model_executor/models/gemma4.py) builds it. Plain data and checks: no torch.

- Full-attention ("global") layers have heads of `global_head_dim` (512 unless given), and,
  where `attention_k_eq_v` is set, `num_global_key_value_heads` KV heads (the class ignores
  that key otherwise). transformers writes these as `per_layer_config` ({full layer: {head_dim,
  num_key_value_heads}}); the published configs as the two keys.
- `attention_k_eq_v`: full layers have no v_proj; V is K's projection (before K's norm and
  RoPE), normed without a scale, as every Gemma 4 layer's V is.
- KV-shared layers: the last `num_kv_shared_layers` layers project no K and V of their own;
  each reads the cache of the last earlier layer of its attention kind (vLLM's
  `kv_sharing_target_layer_name`), and vLLM gives it no KV cache spec.
- Per-layer embeddings (`hidden_size_per_layer_input` > 0): a second table of
  `vocab_size_per_layer_input` rows × layers × that size, and per layer a gate and projection.
- `use_double_wide_mlp`: the KV-shared layers' MLPs are twice `intermediate_size`.
- RoPE per kind: sliding layers the default, full layers "proportional" (only the first
  partial_rotary_factor of each head's frequencies turn; the rest stay 0).
- Its mixture of experts (`enable_moe_block`, the 26B-A4B): every layer's dense MLP runs
  beside routed experts (`gemma4_experts`).
"""
from __future__ import annotations

from kit.errors import ConfigError
from kit.config.families import FULL, GEMMA4_ROPE, SLIDING


def gemma4_layer_types(hf: dict) -> list:
    """Its layers' kinds: config.json's, else every 6th full; the last layer is made full
    either way, as the config class forces it (with a warning)."""
    n = hf["num_hidden_layers"]
    kinds = list(hf.get("layer_types") or [SLIDING if (i + 1) % 6 else FULL for i in range(n)])
    if kinds:
        kinds[-1] = FULL
    return kinds


def global_attention(hf: dict, kinds: list, name: str) -> tuple[int, int | None]:
    """(head_dim, KV heads or None: the model's) of the full layers: from `per_layer_config`
    where transformers wrote one (the same override on every full layer, none elsewhere),
    else `global_head_dim` and `num_global_key_value_heads` (read only with attention_k_eq_v)."""
    per_layer = hf.get("per_layer_config")
    if per_layer is None:
        heads = hf.get("num_global_key_value_heads") if hf["attention_k_eq_v"] else None
        return hf["global_head_dim"], heads
    overrides = {int(k): dict(v) for k, v in per_layer.items()} if isinstance(per_layer, dict) \
        else {}
    full = [i for i, k in enumerate(kinds) if k == FULL]
    values = {tuple(sorted(v.items())) for v in overrides.values()}
    if sorted(overrides) != full or len(values) != 1 or \
            not set(overrides[full[0]]) <= {"head_dim", "num_key_value_heads"}:
        raise ConfigError(f"model {name!r}: per_layer_config must give every full-attention "
                          f"layer ({full}) the same head_dim and num_key_value_heads and no "
                          f"other layer anything (what global_head_dim writes); it has "
                          f"{per_layer!r}")
    one = overrides[full[0]]
    return one.get("head_dim", hf["head_dim"]), one.get("num_key_value_heads")


def gemma4_rope(hf: dict, name: str) -> tuple[float, float, tuple]:
    """(full layers' base, sliding layers' base, the full layers' proportional RoPE as
    (key, value) pairs, () for none)."""
    params = hf.get("rope_parameters") or GEMMA4_ROPE
    full, local = params.get(FULL) or GEMMA4_ROPE[FULL], params.get(SLIDING) or {}
    if (local.get("rope_type") or "default") != "default" or \
            full.get("rope_type") not in ("default", "proportional", None):
        raise ConfigError(f"model {name!r}: Gemma 4's RoPE is 'default' on sliding layers and "
                          f"'default' or 'proportional' on full ones; config.json has {params!r}")
    scaling = (("rope_type", "proportional"),
               ("partial_rotary_factor", full.get("partial_rotary_factor", 1.0)),
               ("factor", full.get("factor", 1.0))) \
        if full.get("rope_type") == "proportional" else ()
    return full.get("rope_theta", 1_000_000.0), local.get("rope_theta", 10_000.0), scaling


def gemma4_fields(hf: dict, name: str) -> dict:
    """`ModelConfig`'s Gemma 4 fields from config.json (its defaults filled in)."""
    if hf.get("attention_bias"):
        raise ConfigError(f"model {name!r}: attention_bias=True is not built for gemma4_text "
                          "(its published sizes have none)")
    n, shared = hf["num_hidden_layers"], hf["num_kv_shared_layers"]
    kinds = gemma4_layer_types(hf)
    if not (isinstance(shared, int) and 0 <= shared < n) or \
            any(k not in kinds[:n - shared] for k in set(kinds[n - shared:])):
        raise ConfigError(f"model {name!r}: num_kv_shared_layers={shared!r} must leave, before "
                          f"the shared layers, a layer of each kind they read; layers {kinds}")
    head_dim, kv_heads = global_attention(hf, kinds, name)
    experts = gemma4_experts(hf, name)
    if experts:
        experts["mlp_kinds"] = ("experts",) * n
    full_theta, local_theta, scaling = gemma4_rope(hf, name)
    return {"layer_types": tuple(kinds), "global_head_dim": head_dim,
            "num_global_key_value_heads": kv_heads, "num_kv_shared_layers": shared,
            "attention_k_eq_v": bool(hf["attention_k_eq_v"]),
            "hidden_size_per_layer_input": hf["hidden_size_per_layer_input"] or 0,
            "vocab_size_per_layer_input": hf["vocab_size_per_layer_input"],
            "use_double_wide_mlp": bool(hf["use_double_wide_mlp"]),
            "rope_theta": full_theta, "rope_local_base_freq": local_theta,
            "rope_scaling": scaling, **experts}


def gemma4_experts(hf: dict, name: str) -> dict:
    """Its mixture of experts (`enable_moe_block`, gemma-4-26B-A4B) as `ModelConfig` holds it
    ({} without): every layer's dense MLP runs beside `num_experts` experts of
    `moe_intermediate_size`, `top_k_experts` per token, their probabilities renormalised (and
    scaled per expert by the router). transformers builds the block on `enable_moe_block`,
    vLLM on `num_experts` being set: the kit needs the keys to agree."""
    keys = ("num_experts", "top_k_experts", "moe_intermediate_size")
    num, top_k, size = (hf.get(k) for k in keys)
    if not hf.get("enable_moe_block"):
        if any(v is not None for v in (num, top_k, size)):
            raise ConfigError(f"model {name!r}: {dict(zip(keys, (num, top_k, size)))} are "
                              "Gemma 4's mixture-of-experts keys, which transformers reads only "
                              "with enable_moe_block and vLLM whenever num_experts is set: "
                              "set enable_moe_block true, or the three null")
        return {}
    if not all(isinstance(v, int) and v > 0 for v in (num, top_k, size)) or top_k > num:
        raise ConfigError(f"model {name!r}: enable_moe_block needs positive whole "
                          f"num_experts, top_k_experts no larger and moe_intermediate_size; "
                          f"config.json has {num!r}, {top_k!r}, {size!r}")
    return {"num_experts": num, "num_experts_per_tok": top_k, "moe_intermediate_size": size,
            "norm_topk_prob": True}


def gemma4_keys(arch) -> dict:
    """config.json's Gemma 4 keys for `arch`, as the published configs write them."""
    return {"global_head_dim": arch.global_head_dim,
            "num_global_key_value_heads": arch.num_global_key_value_heads,
            "num_kv_shared_layers": arch.num_kv_shared_layers,
            "attention_k_eq_v": arch.attention_k_eq_v,
            "hidden_size_per_layer_input": arch.hidden_size_per_layer_input,
            "vocab_size_per_layer_input": arch.vocab_size_per_layer_input,
            "use_double_wide_mlp": arch.use_double_wide_mlp,
            "enable_moe_block": bool(arch.num_experts),
            **({"num_experts": arch.num_experts, "top_k_experts": arch.num_experts_per_tok,
                "moe_intermediate_size": arch.moe_intermediate_size} if arch.num_experts else {}),
            "sliding_window": arch.sliding_window, "layer_types": list(arch.layer_types),
            "final_logit_softcapping": arch.final_logit_softcapping,
            "rope_parameters": {
                SLIDING: {"rope_type": "default", "rope_theta": arch.rope_local_base_freq},
                FULL: {"rope_type": "default", "rope_theta": arch.rope_theta,
                       **{k: v for k, v in dict(arch.rope_scaling).items()
                          if (k, v) != ("factor", 1.0)}}}}  # (transformers warns at a factor)
