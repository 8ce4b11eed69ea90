"""Rotary position embeddings (RoPE), with Llama 3's scaling of the frequencies (chapters 01,
03–05): `rope_cos_sin` once per forward for its positions, `apply_rope` to each layer's queries
and keys.
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


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, scaling: tuple = ()):
    """cos and sin of shape [tokens, head_dim / 2] for the rotary embedding (`scaling`: Llama
    3's, as `ModelConfig.rope_scaling` holds it)."""
    inv_freq = 1.0 / theta ** (
        torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim)
    if scaling:
        inv_freq = llama3_inv_freq(inv_freq, dict(scaling))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    return freqs.cos(), freqs.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [tokens, heads, head_dim], rotating the two halves (the NeoX layout Llama uses)."""
    x1, x2 = x.float().chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
