"""Qwen3-Next's attention (chapters 01, 04, 05), beside its gated delta-nets
(`kit.engine.layers.gated_delta`): q_proj doubled, per head a query and a gate of the output
(`attn_output_gate`), the attention's output × sigmoid(gate) before o_proj; q and k normed per
head (zero-centred, 1 + w, as every Qwen3-Next RMSNorm but the delta-net's gated one:
transformers' `Qwen3NextRMSNorm`, vLLM's `GemmaRMSNorm`), RoPE on the first
partial_rotary_factor of each head (`kit.engine.layers.rotary.apply_rope`); transformers'
`Qwen3NextAttention`, vLLM's `Qwen3NextAttention`.
"""
from __future__ import annotations

import torch

from kit.engine.layers.attention import Attention, AttentionMetadata
from kit.engine.layers.linear import Linear


class GatedAttention(Attention):
    """Attention whose q_proj rows hold, per head, the query then the gate (vLLM's fused
    qkv_proj: [q and gate, k, v])."""

    def __init__(self, arch, layer_idx: int = 0):
        super().__init__(arch, layer_idx)
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.split = (2 * q, kv, kv)
        self.qkv_proj = Linear(arch.hidden_size, sum(self.split), bias=arch.attention_bias)

    def forward(self, x, cos, sin, num_seqs: int, meta: AttentionMetadata | None = None,
                handed_on: dict | None = None):
        """x [tokens, hidden] -> [tokens, hidden] (`Attention.forward`), gated."""
        tokens, d = x.shape[0], self.head_dim
        q_gate, k, v = self.qkv_proj(x).split(self.split, dim=-1)
        q, gate = q_gate.view(tokens, self.num_heads, 2 * d).chunk(2, dim=-1)
        q = self.positioned(q, cos, sin, query=True)
        k = self.positioned(k.view(tokens, self.num_kv_heads, d), cos, sin)
        out = self.attend(q, k, v.view(tokens, self.num_kv_heads, d), num_seqs, meta)
        gated = out.reshape(tokens, -1) * torch.sigmoid(gate.reshape(tokens, -1))
        return self.o_proj(gated)

