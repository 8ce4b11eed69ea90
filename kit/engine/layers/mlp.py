"""The gated MLP and its activation (chapters 01, 03–05): down(act(gate) × up), with SiLU or
GELU as `ModelConfig.hidden_act` names it (Gemma's "gelu" already resolved by `kit.config`).
"""
from __future__ import annotations

import torch.nn.functional as F
from torch import nn

from kit.config import ModelConfig
from kit.engine.layers.linear import Linear


class Relu2MLP(nn.Module):
    """Nemotron-H's MLP-only layers: down(relu(up · x)²), no gate (transformers'
    `NemotronHMLP`, vLLM's `NemotronHMLP` with `ReLUSquaredActivation`)."""

    def __init__(self, arch: ModelConfig, bias: bool = False):
        super().__init__()
        self.up_proj = Linear(arch.hidden_size, arch.intermediate_size, bias=bias)
        self.down_proj = Linear(arch.intermediate_size, arch.hidden_size, bias=bias)

    def forward(self, x):
        return self.down_proj(F.relu(self.up_proj(x)).square())


class MLP(nn.Module):
    def __init__(self, arch: ModelConfig, layer_idx: int = 0,
                 intermediate_size: int | None = None):
        """`intermediate_size`: where not layer `layer_idx`'s (Llama 4's shared expert)."""
        super().__init__()
        inter = intermediate_size or arch.layer_intermediate_size(layer_idx)
        # The gate and up projections in one matrix (vLLM's MergedColumnParallelLinear).
        self.gate_up_proj = Linear(arch.hidden_size, 2 * inter, bias=False)
        self.down_proj = Linear(inter, arch.hidden_size, bias=False)
        self.gelu = arch.hidden_act != "silu"
        # "gelu" is the exact (erf) GELU in transformers; the others are the tanh approximation
        self.approximate = "none" if arch.hidden_act == "gelu" else "tanh"

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        gate = F.gelu(gate, approximate=self.approximate) if self.gelu else F.silu(gate)
        return self.down_proj(gate * up)
