"""Grouped- or multi-query attention over the paged KV cache (chapters 01, 03–05; paged
decode, chapters 04 and 05).

Attention is one method, `Attention.attend`. Without `AttentionMetadata` it is plain causal
attention within each sequence. With it, the layer first writes its keys and values into the
paged cache at its group's `slot_mapping`; a prefill then attends as before, a decode step reads
every sequence's keys and values back through its group's block table (`block_tables`,
`context_lens`). Which group and which of the cache's tensors are a layer's comes from the run's
KV cache layout, bound before the first paged forward (`Attention.bind_kv_cache`), as vLLM's
runner binds each layer to its cache.
Each layer holds its own scale, window and soft cap (`kit.engine.layers.prefill_attention`) as plain
numbers, so compiled code sees constants; Qwen3 and Gemma 3 norm each head's query and key
(`q_norm`, `k_norm`) before RoPE; gpt-oss's layers hold a sink logit per head (`sinks`, a
parameter; None elsewhere) and bias their output projection. Llama 4's layers attend within
chunks (`chunk`) or, without RoPE, to every position with their queries scaled by position
(temperature tuning), and norm q and k after RoPE without a weight (`rms_normalize`). Gemma
4's full layers have their own head size and KV heads, their V may be K's projection (normed
without a scale, as every Gemma 4 V is), and its last layers attend to an earlier layer's keys
and values (`attend_shared`).
"""
from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch
from torch import nn

from kit.config import ModelConfig
from kit.engine.layers.linear import Linear
from kit.engine.layers.norm import NORMS, rms_normalize
from kit.engine.layers.rotary import apply_rope
from kit.engine.layers.state_slots import RecurrentStates
from kit.engine.layers.prefill_attention import prefill_attention, sink_softmax, soft_cap


class AttentionMetadata(NamedTuple):
    """Where a forward's keys and values go in the paged cache, and (decode) where to read them.

    kv_cache:        [slices, 2, num_blocks, block_size, num_kv_heads, head_dim]: vLLM's
                     layout, a slice per place in the widest KV cache group
                     (`kit.engine.kv_cache.allocate`); latent attention's [slices,
                     num_blocks, block_size, latent] (`kit.engine.layers.mla`)
    slot_mapping:    [groups, tokens]: each KV cache group's flat slot (block × block_size +
                     offset) of each token's K and V
    block_tables:    [groups, num_seqs, max_blocks]: one table of block ids per KV cache group
                     and sequence, padded; None for a prefill
    context_lens:    [num_seqs] tokens each sequence attends to (its new token included)
    max_context_len: positions a decode step reads per sequence, fixed for the batch (its
                     longest context, `attention_span`); None: the table's whole width
    states:          the recurrent layers' states, a slot per block id of their groups
                     (`kit.engine.layers.state_slots.RecurrentStates`); None without any

    A NamedTuple, so torch.compile traces it without guarding on Python state but the one int,
    which stays the same for a batch (vLLM's attention metadata carries `max_seq_len` too).
    Layers of different groups share the cache's slices: only their block ids keep them apart.
    """

    kv_cache: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor | None = None
    context_lens: torch.Tensor | None = None
    max_context_len: int | None = None
    states: "RecurrentStates | None" = None


def write_kv(kv_cache: torch.Tensor, cache_slice: int, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store one layer's new keys and values ([tokens, kv_heads, head_dim]) at their slots of
    its slice of the cache.

    One `index_put_` on the whole cache, indexed by (slice, K or V, block, offset): compiled,
    that is an in-place scatter of just these rows. Written through a view instead (one
    layer's cache, or the cache flattened), Inductor copied the whole cache on every step.
    A layer whose token takes r of the cache's rows (`KVCacheLayout.tensor_shape`: Gemma 4's
    global layers with r times the sliding ones' bytes per token) has blocks of block_size / r
    tokens, each page the same bytes, as vLLM's (`unify_kv_cache_spec_page_size`): it writes
    token t of its block at rows t × r to t × r + r - 1."""
    row = kv_cache.shape[-2:]  # a token of the layers with the fewest bytes per token
    rows = k.shape[1] * k.shape[2] // (row[0] * row[1])
    block_size = kv_cache.shape[3] // rows
    block, offset = slot_mapping // block_size, slot_mapping % block_size
    if rows > 1:
        parts = torch.arange(rows, device=slot_mapping.device)
        block = block[:, None].expand(-1, rows).reshape(-1)
        offset = (offset[:, None] * rows + parts).reshape(-1)
    layer = torch.full_like(block, cache_slice)
    kind = torch.cat([torch.zeros_like(block), torch.ones_like(block)])
    kv_cache.index_put_((torch.cat([layer, layer]), kind, torch.cat([block, block]),
                         torch.cat([offset, offset])),
                        torch.cat([k.reshape(-1, *row), v.reshape(-1, *row)]))


# The paged attention's form run eagerly: two matmuls, unless `summed_attention()` asks for the
# summed products compiled code always runs, so chapter 04 can tell what the form buys from
# what the compiler buys. (Compiled code never reads this: the branch is taken while tracing.)
_EAGER_SUMMED = {"on": False}


@contextlib.contextmanager
def summed_attention():
    """Within it, eager paged attention sums products, as compiled code does."""
    before, _EAGER_SUMMED["on"] = _EAGER_SUMMED["on"], True
    try:
        yield
    finally:
        _EAGER_SUMMED["on"] = before


def summed_form() -> bool:
    """Whether the paged attention sums products (always, compiled) or calls two matmuls."""
    return True if torch.compiler.is_compiling() else _EAGER_SUMMED["on"]


# Compiled, the values' weighted sum runs over chunks of this many positions, then over the
# chunks: one long sum per output is a chain of dependent additions, and shorter ones, side by
# side, keep the CPU's vector units busy (docs/measurements.md, "Figures seen while
# building the kit", gives the times seen).
VALUE_CHUNK = 16


def attention_span(longest_context: int, table_positions: int) -> int:
    """Positions a decode step's attention reads per sequence: the batch's longest context
    rounded up to whole VALUE_CHUNKs, within the table's positions (width × block_size)."""
    return min(-(-longest_context // VALUE_CHUNK) * VALUE_CHUNK, table_positions)


def weighted_values(weights: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Σ over positions of weights [seqs, kv_heads, per_kv_head, len] × values [seqs, len,
    kv_heads, dim] -> [seqs, kv_heads, per_kv_head, dim], as summed products in float32, by
    VALUE_CHUNKs of positions where the length divides into them."""
    num_seqs, length, kv_heads, head_dim = v.shape
    v = v.permute(0, 2, 1, 3)[:, :, None].float()  # [seqs, kv_heads, 1, len, dim]
    if length % VALUE_CHUNK:
        return (weights[..., None] * v).sum(-2)
    chunks = (num_seqs, kv_heads, -1, length // VALUE_CHUNK, VALUE_CHUNK)
    products = weights.reshape(chunks)[..., None] * v.reshape(*chunks, head_dim)
    return products.sum(-2).sum(-2)


def paged_decode_attention(q: torch.Tensor, layer_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor,
                           max_context_len: int | None = None, scale: float | None = None,
                           window: int | None = None, softcap: float | None = None,
                           sinks: torch.Tensor | None = None, chunk: int | None = None,
                           zero_masked: bool = False, kv_heads: int | None = None):
    """One query token per sequence ([seqs, heads, head_dim]) against its cached context, gathered
    through the block table: the first `max_context_len` positions of each sequence (default: the
    table's), so every shape depends on the batch only and one compiled graph (or CUDA graph) serves
    every step; positions past a context are masked. `window`: only the blocks holding the last
    `window` positions are read (`window_tables`, a fixed number), older ones masked; `chunk` (Llama
    4): only the new token's chunk. Scores scaled by `scale` (default head_dim^-1/2), capped by
    `softcap`, softmax in float32 with each head's sink logit (`sinks` [heads], gpt-oss) in its
    denominator. `zero_masked`: masked values zeroed first (a hybrid's pages hold states' bytes,
    maybe NaN, and 0 × NaN is NaN). `kv_heads`: the layer's (default: the cache row's), so a layer
    whose tokens take r rows has blocks of r times fewer tokens (Gemma 4's wider global layers,
    `write_kv`); a group of larger blocks than the table was sized for reads only the entries
    holding `max_context_len` positions."""
    num_seqs, width = block_tables.shape
    head_dim, row = q.shape[-1], layer_cache.shape[3] * layer_cache.shape[4]
    kv_heads = kv_heads or row // head_dim
    block_size = layer_cache.shape[2] * row // (kv_heads * head_dim)  # the layer's own
    length, per_kv_head = max_context_len or width * block_size, q.shape[1] // kv_heads
    if (needed := -(-length // block_size)) < width:  # larger blocks than the table's
        width, block_tables = needed, block_tables[:, :needed]
    tables, pos = block_tables, torch.arange(length, device=q.device)[None, :]
    blocks = window_blocks(window or chunk, block_size, width)
    first = first_visible(context_lens, window, chunk)
    if blocks * block_size < length:  # a window narrower than the context: read only it
        tables, pos = window_tables(block_tables, first, blocks, block_size)
        length = pos.shape[1]
    k = layer_cache[0][tables].view(num_seqs, -1, kv_heads, head_dim)[:, :length]
    v = layer_cache[1][tables].view(num_seqs, -1, kv_heads, head_dim)[:, :length]
    visible = pos[:, :length] < context_lens[:, None]
    if first is not None:
        visible = visible & (pos[:, :length] >= first[:, None])
    if zero_masked:
        v = torch.where(visible[:, :, None, None], v, 0)
    # The same arithmetic two ways (`summed_form`, taken once while tracing; `summed_attention`
    # sums eagerly too): eagerly two matmuls; compiled, products summed over [seqs, kv_heads,
    # per_kv_head, len, dim] (a KV head's queries side by side), one Inductor kernel gathering
    # through the table as it goes, faster than compiled matmuls (docs/measurements.md).
    summed = summed_form()
    if summed:
        qg = q.view(num_seqs, kv_heads, per_kv_head, 1, head_dim).float()
        scores = (qg * k.permute(0, 2, 1, 3)[:, :, None].float()).sum(-1)
    else:
        scores = torch.matmul(q.view(num_seqs, kv_heads, per_kv_head, head_dim),
                              k.permute(0, 2, 3, 1)).float()
    scores = scores * (scale or head_dim ** -0.5)
    if softcap is not None:
        scores = soft_cap(scores, softcap)
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    weights = sink_softmax(scores, None if sinks is None
                           else sinks.view(1, kv_heads, per_kv_head, 1))
    if summed:
        out = weighted_values(weights, v)
    else:
        out = torch.matmul(weights.to(q.dtype), v.transpose(1, 2))
    return out.to(q.dtype).reshape(q.shape)


def window_blocks(window: int | None, block_size: int, width: int) -> int:
    """Blocks that can hold a window's last `window` positions (it may start mid-block): the
    table's whole width for full attention."""
    if window is None:
        return width
    return min(width, (window + block_size - 2) // block_size + 1)


def first_visible(context_lens: torch.Tensor, window: int | None,
                  chunk: int | None) -> torch.Tensor | None:
    """The earliest position each sequence's new token (at context_len - 1) sees: the window's
    first, or its chunk's first (a multiple of `chunk`); None: every position."""
    if chunk is not None:
        return (context_lens - 1) // chunk * chunk
    return None if window is None else (context_lens - window).clamp(min=0)


def window_tables(block_tables: torch.Tensor, first_pos: torch.Tensor, blocks: int,
                  block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The `blocks` table entries per sequence that hold its window or chunk (from the block
    holding position `first_pos`, kept within the table), and the positions [seqs, blocks ×
    block_size] they hold. A fixed number of blocks: a sliding layer's step reads the same
    bytes at any context."""
    width = block_tables.shape[1]
    first = (first_pos // block_size).clamp(max=width - blocks)
    entries = first[:, None] + torch.arange(blocks, device=block_tables.device)[None, :]
    offsets = torch.arange(block_size, device=block_tables.device)
    pos = (entries[:, :, None] * block_size + offsets).reshape(len(entries), -1)
    return block_tables.gather(1, entries), pos


class Attention(nn.Module):
    def __init__(self, arch: ModelConfig, layer_idx: int = 0):
        super().__init__()
        self.layer_idx = layer_idx
        # its KV cache group (whose block table it reads) and its slice of the cache: set from
        # the run's layout by `bind_kv_cache`
        self.kv_group = self.cache_slice = None
        self.zero_masked = False
        self.num_heads = arch.num_attention_heads
        self.num_kv_heads = arch.layer_kv_heads(layer_idx)  # Gemma 4's full layers: their own
        self.head_dim = arch.layer_head_dim(layer_idx)
        # per layer, plain numbers: compiled code sees constants
        self.scale, self.window = arch.attention_scale, arch.window(layer_idx)
        self.chunk, self.rope = arch.chunk(layer_idx), arch.uses_rope(layer_idx)
        # Llama 4: its RoPE layers' q and k RMS-normed without a weight, after RoPE
        self.l2_norm_eps = arch.rms_norm_eps if arch.qk_l2_norm and self.rope else None
        self.softcap = arch.attn_logit_softcapping
        # Gemma 4: a KV-shared layer attends to the keys and values of layer `kv_source` (in a
        # prefill as that layer hands them on, in decode from its cache) and projects only Q;
        # an attention_k_eq_v layer takes V from K's projection; V is normed without a scale
        self.kv_source = arch.kv_source(layer_idx)
        self.hands_on_kv = any(arch.kv_source(i) == layer_idx != i
                               for i in range(arch.num_hidden_layers))
        self.v_norm = arch.rms_norm_eps if arch.parts.v_norm else None
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.split = (q, kv, kv)[:1 + arch.has_kv_cache(layer_idx) + arch.has_v_proj(layer_idx)]
        # Q, K and V in one matrix, as vLLM's QKVParallelLinear holds them: one product per
        # layer instead of three, which streams the weights faster at a decode batch.
        self.qkv_proj = Linear(arch.hidden_size, sum(self.split), bias=arch.attention_bias)
        self.o_proj = Linear(q, arch.hidden_size, bias=arch.attention_bias and arch.parts.o_bias)
        self.sinks = nn.Parameter(torch.empty(self.num_heads)) if arch.parts.sinks else None
        self.qk_norm = arch.parts.qk_norm
        if self.qk_norm:  # each head's query and key normed over head_dim, before RoPE
            self.q_norm = NORMS[arch.parts.norm](self.head_dim, arch.rms_norm_eps)
            if len(self.split) > 1:
                self.k_norm = NORMS[arch.parts.norm](self.head_dim, arch.rms_norm_eps)

    def forward(self, x, cos, sin, num_seqs: int, meta: AttentionMetadata | None = None,
                handed_on: dict | None = None):
        """x [tokens, hidden]; `cos` and `sin` RoPE's at each token's position, or for a layer
        without RoPE (Llama 4's NoPE layers) `cos` each token's query scale [tokens] (None:
        none) and `sin` None (`kit.engine.model.Decoder.rope_tables`). `handed_on`: layer ->
        its prefill's keys and values, for the layers that read them (Gemma 4's KV-shared
        layers; None for every other family)."""
        tokens = x.shape[0]
        q, *kv = self.qkv_proj(x).split(self.split, dim=-1)
        q = q.view(tokens, self.num_heads, self.head_dim)
        q = self.positioned(q, cos, sin, query=True)
        if not kv:  # a KV-shared layer: its source's keys and values
            out = self.attend_shared(q, num_seqs, meta, handed_on)
            return self.o_proj(out.reshape(tokens, self.num_heads * self.head_dim))
        k = kv[0].view(tokens, self.num_kv_heads, self.head_dim)
        v = kv[-1].view(tokens, self.num_kv_heads, self.head_dim)  # K's own with K = V
        if self.v_norm is not None:
            v = rms_normalize(v, self.v_norm)
        k = self.positioned(k, cos, sin)
        if self.hands_on_kv:
            handed_on[self.layer_idx] = (k, v)
        out = self.attend(q, k, v, num_seqs, meta)
        return self.o_proj(out.reshape(tokens, self.num_heads * self.head_dim))

    def positioned(self, t, cos, sin, query: bool = False):
        """A query's or key's heads [tokens, heads, head_dim] normed (QK-norm) then rotated,
        or for a NoPE layer's query scaled by its temperature (Llama 4), then normed without a
        weight where the family does (Llama 4's RoPE layers)."""
        if self.qk_norm:
            t = self.q_norm(t) if query else self.k_norm(t)
        if self.rope:
            t = apply_rope(t, cos, sin)
        elif query and cos is not None:  # Llama 4's temperature tuning of NoPE layers' queries
            t = (t * cos[:, None, None]).to(t.dtype)
        return t if self.l2_norm_eps is None else rms_normalize(t, self.l2_norm_eps)

    def attend_shared(self, q, num_seqs: int, meta: AttentionMetadata | None, handed_on):
        """A KV-shared layer's attention: a decode step reads its source layer's paged cache
        (bound to it, `bind_kv_cache`) and writes nothing; a prefill attends to the keys and
        values the source layer computed in this forward."""
        if meta is not None and meta.block_tables is not None:
            return paged_decode_attention(q, meta.kv_cache[self.cache_slice],
                                          meta.block_tables[self.kv_group], meta.context_lens,
                                          meta.max_context_len, self.scale, self.window,
                                          self.softcap, self.sinks,
                                          zero_masked=self.zero_masked,
                                          kv_heads=self.num_kv_heads)
        k, v = handed_on[self.kv_source]
        return self.attend(q, k, v, num_seqs)

    def bind_kv_cache(self, layout) -> None:
        """Take this layer's KV cache group and cache slice from `layout` (a
        `kit.engine.kv_cache.KVCacheLayout`), and whether its pages hold recurrent states too
        (`paged_decode_attention`'s zero_masked): plain values, constants to compiled code."""
        self.kv_group, self.cache_slice = layout.place(self.layer_idx)
        self.zero_masked = layout.has_states

    def attend(self, q, k, v, num_seqs: int, meta: AttentionMetadata | None = None):
        """Causal attention within each of `num_seqs` equal-length sequences, over the layer's
        window if it has one; with `meta`, the keys and values are also written to the paged
        cache, and a decode step (one token per sequence, `meta.block_tables` given) reads its
        context back from there."""
        if meta is not None:
            if self.kv_group is None:
                raise RuntimeError("the model's layers have no KV cache: call "
                                   "model.bind_kv_cache(layout) before a paged forward")
            write_kv(meta.kv_cache, self.cache_slice, k, v, meta.slot_mapping[self.kv_group])
            if meta.block_tables is not None:
                return paged_decode_attention(q, meta.kv_cache[self.cache_slice],
                                              meta.block_tables[self.kv_group],
                                              meta.context_lens, meta.max_context_len,
                                              self.scale, self.window, self.softcap,
                                              self.sinks, self.chunk, self.zero_masked,
                                              self.num_kv_heads)

        def per_seq(t):  # [tokens, heads, dim] -> [seqs, heads, len, dim]
            return t.view(num_seqs, -1, t.shape[1], self.head_dim).transpose(1, 2)
        out = prefill_attention(per_seq(q), per_seq(k), per_seq(v), self.scale, self.window,
                                self.softcap, self.sinks, self.chunk)
        return out.transpose(1, 2).reshape(q.shape)
