"""Gemma 4's mixture of experts (`enable_moe_block`, gemma-4-26B-A4B; chapters 01, 04): beside
every layer's dense MLP, a router picks k of E experts (`kit.engine.layers.experts.Experts`)
from the residual stream, as transformers 5.19's `Gemma4TextRouter` and vLLM 0.32's
`Gemma4Router` do:

    logits  = proj(rmsnorm(x) × H^-1/2 × scale)            (rmsnorm without its own scale)
    weights = the k largest softmax probabilities (float32), renormalised to sum to 1, each
              times its expert's `per_expert_scale`

The experts read the residual stream through their own norm (`pre_feedforward_layernorm_2`),
and the layer adds both outputs, each normed (`kit.engine.model.Gemma4Layer`).
"""
from __future__ import annotations

import torch
from torch import nn

from kit.config import ModelConfig
from kit.engine.layers.experts import SparseMoE, route
from kit.engine.layers.norm import rms_normalize


class Gemma4MoE(SparseMoE):
    """The router (`gate`: its projection [E, H], `scale` [H], `per_expert_scale` [E]) and
    the experts. A `SparseMoE`, so its picks are noted as every family's are
    (`kit.engine.layers.experts.noting_picks`)."""

    def __init__(self, arch: ModelConfig, layer_idx: int = 0):
        super().__init__(arch, layer_idx)
        self.scale = nn.Parameter(torch.empty(arch.hidden_size))
        self.per_expert_scale = nn.Parameter(torch.empty(arch.num_experts))
        self.eps, self.root = arch.rms_norm_eps, arch.hidden_size ** -0.5

    def router_logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.gate(rms_normalize(x, self.eps) * self.root * self.scale)

    def picks(self, logits: torch.Tensor, ids: torch.Tensor | None = None):
        """The top k (or the given `ids`), renormalised, each times its expert's scale."""
        weights, ids = route(logits, self.top_k, True, ids)
        return weights * self.per_expert_scale[ids].float(), ids

    def forward(self, x: torch.Tensor, experts_input: torch.Tensor) -> torch.Tensor:
        """Routed on the residual stream `x`, run on `experts_input` (its normed copy)."""
        return self.experts(experts_input, *self.route(x))
