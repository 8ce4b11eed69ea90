"""Rotary position embeddings (RoPE), with Llama 3's, YaRN's or Gemma 4's proportional scaling of the frequencies
(chapters 01, 03–05): `rope_cos_sin` once per forward for its positions, `apply_rope` (or
`apply_rope_pairs`, DeepSeek) to each
layer's queries and keys. YaRN also multiplies cos and sin by its attention factor.
"""
from __future__ import annotations

import math

import torch


def llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3's RoPE scaling: wavelengths past the original context's are stretched by
    `factor`, those under it / high_freq_factor kept, and the band between interpolated."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    context = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > context / low, inv_freq / factor, inv_freq)
    smooth = (context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= context / high) & (wavelen <= context / low)
    return torch.where(medium, smoothed, scaled)


def yarn_inv_freq(inv_freq: torch.Tensor, theta: float, scaling: dict) -> torch.Tensor:
    """YaRN (gpt-oss, Qwen): frequencies that turn fewer than `beta_slow` times over the
    original context are divided by `factor`, those turning more than `beta_fast` times kept,
    and a linear ramp between (transformers' `_compute_yarn_parameters`, vLLM's the same)."""
    dim, factor = 2 * inv_freq.numel(), scaling["factor"]
    context = scaling["original_max_position_embeddings"]

    def dim_of(rotations):  # the dimension whose frequency turns `rotations` times
        return dim * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(theta))
    low, high = dim_of(scaling["beta_fast"]), dim_of(scaling["beta_slow"])
    if scaling["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = (torch.arange(dim // 2, dtype=torch.float32, device=inv_freq.device) - low) \
        / (high - low if high != low else 0.001)
    kept = 1 - ramp.clamp(0, 1)  # 1: extrapolated (kept), 0: interpolated (divided)
    return inv_freq / factor * (1 - kept) + inv_freq * kept


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, scaling: tuple = ()):
    """cos and sin of shape [tokens, head_dim / 2] for the rotary embedding (`scaling`: Llama
    3's or YaRN's, as `ModelConfig.rope_scaling` holds it)."""
    inv_freq = 1.0 / theta ** (
        torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim)
    # `dict` only where there is a scaling: traced, it costs Dynamo guards on every model
    scaling, factor = dict(scaling) if scaling else {}, 1.0
    if scaling.get("rope_type") == "llama3":
        inv_freq = llama3_inv_freq(inv_freq, scaling)
    elif scaling.get("rope_type") == "yarn":
        inv_freq, factor = yarn_inv_freq(inv_freq, theta, scaling), scaling["attention_factor"]
    elif scaling.get("rope_type") == "proportional":  # Gemma 4's full layers: only the first
        # partial_rotary_factor of the frequencies turn, the rest are 0 (cos 1, sin 0), all
        # divided by `factor` (transformers' `_compute_proportional_rope_parameters`)
        turning = int(scaling["partial_rotary_factor"] * head_dim // 2)
        inv_freq = torch.cat([inv_freq[:turning], torch.zeros_like(inv_freq[turning:])]) \
            / scaling["factor"]
    freqs = positions.float()[:, None] * inv_freq[None, :]
    if factor == 1.0:
        return freqs.cos(), freqs.sin()
    return freqs.cos() * factor, freqs.sin() * factor


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [tokens, heads, head_dim], rotating the two halves (the NeoX layout Llama uses) of
    its first 2 × cos.shape[-1] elements; the rest, where there are more (Qwen3-Next's
    partial_rotary_factor), pass unturned."""
    turned = 2 * cos.shape[-1]
    if turned < x.shape[-1]:
        return torch.cat([apply_rope(x[..., :turned], cos, sin), x[..., turned:]], dim=-1)
    x1, x2 = x.float().chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def apply_rope_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [tokens, heads, dim], rotating pairs of adjacent elements (2i, 2i + 1): DeepSeek's
    layout (transformers' `apply_rotary_emb` on complex pairs, vLLM's is_neox_style=False)."""
    pairs = x.float().unflatten(-1, (-1, 2))
    x1, x2, cos, sin = pairs[..., 0], pairs[..., 1], cos[:, None, :], sin[:, None, :]
    return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2) \
        .to(x.dtype)
