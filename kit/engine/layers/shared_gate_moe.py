"""Qwen3-Next's experts (chapters 01, 04, 05): softmax top k routed experts plus a shared
expert every token runs, its output × sigmoid(shared_expert_gate(x)) (transformers' and
vLLM's `Qwen3NextSparseMoeBlock`).
"""
from __future__ import annotations

import torch

from kit.engine.layers.experts import SparseMoE
from kit.engine.layers.linear import Linear
from kit.engine.layers.mlp import MLP


class SharedGateMoE(SparseMoE):
    """Routed experts plus a shared expert scaled per token by a sigmoid gate."""

    def __init__(self, arch, layer_idx: int = 0):
        super().__init__(arch, layer_idx)
        width = arch.shared_expert_intermediate_size
        self.shared_expert = MLP(arch, intermediate_size=width) if width else None
        self.shared_expert_gate = Linear(arch.hidden_size, 1, bias=False) if width else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        routed = self.experts(x, *self.route(x))
        if self.shared_expert is None:
            return routed
        return routed + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)

