"""Multi-head latent attention (DeepSeek-V2 and V3; chapters 01, 04, 05): every token keeps one latent
for all heads, and the paged cache holds that latent alone (vLLM's `MLAAttentionSpec`).

    query     q = q_proj(x), or q_b_proj(q_a_layernorm(q_a_proj(x))) with q_lora_rank:
              per head a part without position (qk_nope_head_dim) and a rotary part
              (qk_rope_head_dim)
    latent    kv_a_proj_with_mqa(x) -> c_kv (kv_lora_rank), normed by kv_a_layernorm, and
              one rotary key k_pe (qk_rope_head_dim) shared by every head; RoPE on pairs of
              adjacent elements (`apply_rope_pairs`) of q's rotary part and k_pe only
    cache     per token and layer: [c_kv, k_pe], kv_lora_rank + qk_rope_head_dim elements
    heads     kv_b_proj(c_kv) -> per head k_nope (qk_nope_head_dim) and v (v_head_dim)

A prefill attends in the plain form, as transformers does: keys [k_nope, k_pe] and values
per head from kv_b_proj, scores scaled by `ModelConfig.attention_scale` ((qk_nope +
qk_rope)^-1/2, times YaRN's mscale²). A decode step attends in the absorbed form vLLM's MLA
backends use (vllm/model_executor/layers/attention/mla_attention.py, `_v_up_proj` and
`W_UK_T`): kv_b_proj's rows split into W_UK [heads, qk_nope, rank] and W_UV [heads, v, rank];
the query's non-rotary part moves into latent space (q_nope · W_UK, [heads, rank]), so

    scores = q_latent · c_kv + q_pe · k_pe       over the cached latents, read through the
    out    = (softmax(scores) · c_kv) · W_UVᵀ     block table, never expanded per head

which is the plain form's arithmetic reassociated: a step reads rank + rope elements per
token for all heads, not 2 × heads × head_dim.
"""
from __future__ import annotations

import torch
from torch import nn

from kit.config import ModelConfig
from kit.engine.layers.attention import AttentionMetadata
from kit.engine.layers.linear import Linear
from kit.engine.layers.norm import RMSNorm
from kit.engine.layers.prefill_attention import prefill_attention
from kit.engine.layers.rotary import apply_rope_pairs


def write_latent(kv_cache: torch.Tensor, cache_slice: int, latent: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    """Store one layer's new latents [tokens, rank + rope] at their slots of its slice of the
    cache [slices, num_blocks, block_size, rank + rope], in one `index_put_` (as `write_kv`)."""
    block_size = kv_cache.shape[2]
    layer = torch.full_like(slot_mapping, cache_slice)
    kv_cache.index_put_((layer, slot_mapping // block_size, slot_mapping % block_size),
                        latent.to(kv_cache.dtype))


def absorbed_decode(q_latent: torch.Tensor, q_pe: torch.Tensor, layer_cache: torch.Tensor,
                    block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                    max_context_len: int | None = None) -> torch.Tensor:
    """One query per sequence in latent space (q_latent [seqs, heads, rank], q_pe [seqs,
    heads, rope]) against its cached latents (`layer_cache` [num_blocks, block_size, rank +
    rope], read through `block_tables` [seqs, width], the first `max_context_len` positions)
    -> softmax-weighted latents [seqs, heads, rank], float32. Positions past a sequence's
    context are masked; the softmax runs in float32."""
    num_seqs, width = block_tables.shape
    rank, block_size = q_latent.shape[-1], layer_cache.shape[1]
    length = max_context_len or width * block_size
    cached = layer_cache[block_tables].view(num_seqs, -1, layer_cache.shape[-1])[:, :length]
    c_kv, k_pe = cached.float().split([rank, cached.shape[-1] - rank], dim=-1)
    scores = (torch.einsum("shr,slr->shl", q_latent.float(), c_kv)
              + torch.einsum("shp,slp->shl", q_pe.float(), k_pe)) * scale
    visible = torch.arange(length, device=q_latent.device)[None, :] < context_lens[:, None]
    scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
    return torch.einsum("shl,slr->shr", scores.softmax(-1), c_kv)


class LatentAttention(nn.Module):
    """DeepSeek's attention under its checkpoint names (q_proj or q_a_proj, q_a_layernorm,
    q_b_proj; kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj; o_proj), none biased (vLLM's)."""

    def __init__(self, arch: ModelConfig, layer_idx: int = 0):
        super().__init__()
        self.layer_idx = layer_idx
        self.kv_group = self.cache_slice = None  # set by `bind_kv_cache`
        h, self.num_heads = arch.hidden_size, arch.num_attention_heads
        self.nope, self.rope = arch.qk_nope_head_dim, arch.qk_rope_head_dim
        self.rank, self.v_dim = arch.kv_lora_rank, arch.v_head_dim
        q_out = self.num_heads * (self.nope + self.rope)
        self.q_lora = bool(arch.q_lora_rank)
        if self.q_lora:
            self.q_a_proj = Linear(h, arch.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(arch.q_lora_rank, arch.rms_norm_eps)
            self.q_b_proj = Linear(arch.q_lora_rank, q_out, bias=False)
        else:
            self.q_proj = Linear(h, q_out, bias=False)
        self.kv_a_proj_with_mqa = Linear(h, self.rank + self.rope, bias=False)
        self.kv_a_layernorm = RMSNorm(self.rank, arch.rms_norm_eps)
        self.kv_b_proj = Linear(self.rank, self.num_heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = Linear(self.num_heads * self.v_dim, h, bias=False)
        self.scale = arch.attention_scale

    def query(self, x: torch.Tensor) -> torch.Tensor:
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.q_lora \
            else self.q_proj(x)
        return q.view(x.shape[0], self.num_heads, self.nope + self.rope)

    def forward(self, x, cos, sin, num_seqs: int, meta: AttentionMetadata | None = None,
                handed_on: dict | None = None):
        """x [tokens, hidden] -> [tokens, hidden]; `cos`, `sin` RoPE's over qk_rope_head_dim.
        With `meta`, each token's latent is written to the paged cache; a decode step
        (`meta.block_tables` given) reads the context's latents back, absorbed."""
        tokens = x.shape[0]
        q_nope, q_pe = self.query(x).split([self.nope, self.rope], dim=-1)
        q_pe = apply_rope_pairs(q_pe, cos, sin)
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope], dim=-1)
        c_kv = self.kv_a_layernorm(c_kv)
        k_pe = apply_rope_pairs(k_pe[:, None], cos, sin)[:, 0]
        if meta is not None:
            if self.kv_group is None:
                raise RuntimeError("the model's layers have no KV cache: call "
                                   "model.bind_kv_cache(layout) before a paged forward")
            write_latent(meta.kv_cache, self.cache_slice, torch.cat([c_kv, k_pe], dim=-1),
                         meta.slot_mapping[self.kv_group])
        if meta is not None and meta.block_tables is not None:
            out = self.decode(q_nope, q_pe, meta)
        else:
            out = self.plain(q_nope, q_pe, c_kv, k_pe, num_seqs)
        return self.o_proj(out.reshape(tokens, self.num_heads * self.v_dim))

    def plain(self, q_nope, q_pe, c_kv, k_pe, num_seqs: int) -> torch.Tensor:
        """Causal attention within each of `num_seqs` equal-length sequences, keys and values
        expanded per head (transformers' form) -> [tokens, heads, v_head_dim]."""
        tokens, heads = q_nope.shape[:2]
        k_nope, v = self.kv_b_proj(c_kv).view(tokens, heads, -1).split(
            [self.nope, self.v_dim], dim=-1)
        q = torch.cat([q_nope, q_pe], dim=-1)
        k = torch.cat([k_nope, k_pe[:, None].expand(-1, heads, -1)], dim=-1)

        # V padded with zeros to the query's head size, as vLLM's MLA prefill pads it for
        # flash attention: SDPA's fused CPU kernel takes equal sizes only, and its fallback
        # holds every score (tiny-mla's eager memory profile: a 59 MB peak, 33 MB padded)
        v = torch.nn.functional.pad(v, (0, q.shape[-1] - self.v_dim))

        def per_seq(t):  # [tokens, heads, dim] -> [seqs, heads, len, dim]
            return t.reshape(num_seqs, -1, heads, t.shape[-1]).transpose(1, 2)
        out = prefill_attention(per_seq(q), per_seq(k), per_seq(v), self.scale)
        return out[..., :self.v_dim].transpose(1, 2).reshape(tokens, heads, self.v_dim)

    def decode(self, q_nope, q_pe, meta: AttentionMetadata) -> torch.Tensor:
        """The absorbed form (module docstring) -> [seqs, heads, v_head_dim]."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_dim, self.rank)
        w_uk, w_uv = w.float().split([self.nope, self.v_dim], dim=1)
        q_latent = torch.einsum("shn,hnr->shr", q_nope.float(), w_uk)  # W_UK absorbed
        latent = absorbed_decode(q_latent, q_pe, meta.kv_cache[self.cache_slice],
                                 meta.block_tables[self.kv_group], meta.context_lens,
                                 self.scale, meta.max_context_len)
        return torch.einsum("shr,hvr->shv", latent, w_uv).to(q_nope.dtype)

    def bind_kv_cache(self, layout) -> None:
        """Take this layer's KV cache group and cache slice from `layout`."""
        self.kv_group, self.cache_slice = layout.place(self.layer_idx)
