"""What attention does to its scores besides q·k times a scale (chapters 01, 03–05): a sliding
window that hides keys older than the last `window` positions (Mistral, Gemma 2 and 3, Qwen),
and Gemma 2's soft-capping of the scores. `prefill_attention` is the attention within each
sequence: SDPA's fused kernel, but written out (matmul, cap, mask, softmax) when the scores are
capped, which SDPA cannot do.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def soft_cap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """cap · tanh(x / cap): x squeezed into (-cap, cap), nearly unchanged where |x| << cap."""
    return cap * torch.tanh(x / cap)


def visible_keys(query_pos: torch.Tensor, key_pos: torch.Tensor,
                 window: int | None = None) -> torch.Tensor:
    """[queries, keys]: True where a query sees a key. Causal, and with `window` only the last
    `window` positions, the query's own included (transformers' sliding mask: key > query -
    window; vLLM's too)."""
    keep = key_pos[None, :] <= query_pos[:, None]
    if window is not None:
        keep = keep & (key_pos[None, :] > query_pos[:, None] - window)
    return keep


def prefill_attention(q, k, v, scale: float, window: int | None = None,
                      softcap: float | None = None) -> torch.Tensor:
    """Causal attention within each sequence: q [seqs, heads, len, dim], k and v [seqs, kv_heads,
    len, dim] -> [seqs, heads, len, dim]. Full attention without a cap is SDPA's causal kernel,
    a window its mask; capped scores are computed in float32, as are their softmax."""
    gqa = q.shape[1] != k.shape[1]
    if softcap is None and window is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                              enable_gqa=gqa)
    pos = torch.arange(q.shape[2], device=q.device)
    mask = visible_keys(pos, pos, window)
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                              enable_gqa=gqa)
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = soft_cap(torch.matmul(q, k.transpose(-1, -2)).float() * scale, softcap)
    weights = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    return torch.matmul(weights.to(q.dtype), v)
