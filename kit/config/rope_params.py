"""How config.json gives RoPE: its bases (full and sliding layers) and Llama 3's or YaRN's
scaling, as transformers 5 (`rope_parameters`) and 4.x (`rope_theta`, `rope_scaling`) write it
and as transformers' `_compute_*_parameters` fill in what is left out. Plain data: no torch."""
from __future__ import annotations

import math

from kit.config.families import FULL, SLIDING
from kit.errors import ConfigError


def rope(hf: dict, name: str) -> tuple[float, float | None, tuple]:
    """RoPE's base for full layers, for sliding ones (None: the same) and Llama 3's or YaRN's
    scaling.
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
    return theta, local_theta, rope_scaling(hf.get("rope_scaling") or full, name,
                                            hf.get("max_position_embeddings", 2048))


LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor",
                    "original_max_position_embeddings")
# YaRN's keys as transformers reads them, with its defaults (None: derived: the original
# context is max_position_embeddings, the factor their ratio, the attention factor
# 0.1·ln(factor) + 1, or DeepSeek's ratio of two such terms when `mscale` and `mscale_all_dim`
# are given).
YARN_ROPE_KEYS = {"factor": None, "original_max_position_embeddings": None, "beta_fast": 32.0,
                  "beta_slow": 1.0, "truncate": True, "attention_factor": None}


def rope_scaling(params: dict, name: str, max_positions: int = 2048) -> tuple:
    """Llama 3's or YaRN's RoPE scaling (`rope_scaling`, or transformers 5's
    `rope_parameters`) as (key, value) pairs, its "rope_type" first, () for none; every other
    kind refused, since ignoring it would give a real checkpoint wrong logits."""
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind == "default":
        return ()
    if kind == "yarn":
        return (("rope_type", "yarn"), *yarn_scaling(params, max_positions))
    missing = [k for k in LLAMA3_ROPE_KEYS if k not in params]
    if kind != "llama3" or missing:
        raise ConfigError(f"model {name!r}: rope scaling {kind!r} "
                          f"{'lacks ' + str(missing) if kind == 'llama3' else 'is not supported'}"
                          "; the kit's RoPE covers none, Llama 3's ('llama3') and YaRN ('yarn')")
    return (("rope_type", "llama3"), *((k, params[k]) for k in LLAMA3_ROPE_KEYS))


def yarn_scaling(params: dict, max_positions: int) -> tuple:
    """YaRN's settings with transformers' defaults filled in and the attention factor (what
    cos and sin are multiplied by) derived where not given (`_compute_yarn_parameters`)."""
    got = {k: params.get(k) if params.get(k) is not None else d
           for k, d in YARN_ROPE_KEYS.items()}
    original = got["original_max_position_embeddings"] = \
        got["original_max_position_embeddings"] or max_positions
    factor = got["factor"] = got["factor"] or max_positions / original

    def mscale(m=1.0):
        return 0.1 * m * math.log(factor) + 1.0 if factor > 1 else 1.0
    if got["attention_factor"] is None:
        both = params.get("mscale") and params.get("mscale_all_dim")
        got["attention_factor"] = mscale(params["mscale"]) / mscale(params["mscale_all_dim"]) \
            if both else mscale()
    return tuple(got.items())
