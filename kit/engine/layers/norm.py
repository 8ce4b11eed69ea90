"""RMSNorm, the norm of every family the decoder covers (chapters 01, 03–05).

`NORMS` names its kinds as a family's description does (`kit.config.Parts.norm`): "rms", the
scale as stored (Llama, Mistral, Qwen2), and "gemma_rms", the scale stored as an offset from 1.
"""
from __future__ import annotations

from functools import partial

import torch
from torch import nn


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x over its last dim divided by its root mean square, in float32, no scale (Llama 4's
    `Llama4TextL2Norm`, vLLM's RMSNorm without a weight; Gemma 4's `v_norm`,
    `with_scale=False`)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, gemma: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps, self.gemma = eps, gemma

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        w = self.weight.float()
        # Gemma stores the scale as an offset from 1.
        return (xf * (1.0 + w if self.gemma else w)).to(x.dtype)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """The scale that leaves the normalized input as it is (1, which Gemma stores as 0)."""
        self.weight.fill_(0.0 if self.gemma else 1.0)


NORMS = {"rms": RMSNorm, "gemma_rms": partial(RMSNorm, gemma=True)}
