"""What attention does to its scores besides q·k times a scale (chapters 01, 03–05): a sliding
window that hides keys older than the last `window` positions (Mistral, Gemma 2 and 3, Qwen),
chunks that hide keys outside the query's own chunk of positions (Llama 4),
Gemma 2's soft-capping of the scores, and gpt-oss's sinks (one learned logit per head that
joins the softmax's denominator, its weight then dropped: a head may attend to nothing).
`prefill_attention` is the attention within each sequence: SDPA's fused kernel, but written out
(matmul, cap, mask, softmax) when the scores are capped or sunk, which SDPA cannot do.

A window or a cap materialises the scores: SDPA with a mask and grouped KV heads runs its math
kernel, in float32 on a GPU, and the capped form writes them out itself. Their bytes grow with
the square of the prompt (8 prompts of 8,176 tokens and 8 heads: 17 GB per score tensor), so
above MAX_SCORE_BYTES the queries go in chunks, each against only the keys it can see (causal,
and within the window): the same result up to float rounding, in bounded memory.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kit.units import GiB

# The most bytes one materialised score tensor (float32: seqs × heads × queries × keys) may
# take before the queries are chunked. Above every CPU preset's prefill (the largest, cpu-real's
# chapter 04 at 8 × 14 heads × 2,032², is 1.7 GiB), so their numbers stay the unchunked ones.
MAX_SCORE_BYTES = 2 * GiB
SCORE_BYTES = 4  # float32


def soft_cap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """cap · tanh(x / cap): x squeezed into (-cap, cap), nearly unchanged where |x| << cap."""
    return cap * torch.tanh(x / cap)


def sink_softmax(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """The softmax over the last dim of float32 `scores`, with each head's sink logit (`sinks`,
    shaped to broadcast against scores[..., :1]) in the denominator and its weight dropped, as
    transformers' and vLLM's gpt-oss do; the plain softmax without sinks."""
    if sinks is None:
        return scores.softmax(-1)
    sink = sinks.float().expand(*scores.shape[:-1], 1)
    return torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]


def visible_keys(query_pos: torch.Tensor, key_pos: torch.Tensor,
                 window: int | None = None, chunk: int | None = None) -> torch.Tensor:
    """[queries, keys]: True where a query sees a key. Causal, and with `window` only the last
    `window` positions, the query's own included (transformers' sliding mask: key > query -
    window; vLLM's too); with `chunk` only the keys of the query's own chunk of `chunk`
    positions (Llama 4: transformers' `chunked_overlay`, key // chunk == query // chunk)."""
    keep = key_pos[None, :] <= query_pos[:, None]
    if window is not None:
        keep = keep & (key_pos[None, :] > query_pos[:, None] - window)
    if chunk is not None:
        keep = keep & (key_pos[None, :] // chunk == query_pos[:, None] // chunk)
    return keep


def earliest_key(query: int, window: int | None, chunk: int | None) -> int:
    """The earliest position query position `query` can see."""
    if chunk is not None:
        return query // chunk * chunk
    return 0 if window is None else max(0, query - window + 1)


def query_chunk(num_seqs: int, heads: int, length: int, window: int | None,
                max_score_bytes: int = MAX_SCORE_BYTES) -> int:
    """Queries per chunk so that a chunk's float32 scores stay within `max_score_bytes`: all
    `length` when the whole score tensor fits. A chunk of r queries sees at most r + window - 1
    keys with a window, all `length` of them without one (its last chunk does)."""
    per_pair = num_seqs * heads * SCORE_BYTES  # bytes of one (query, key) score
    if per_pair * length * length <= max_score_bytes:
        return length
    pairs = max(1, max_score_bytes // per_pair)
    if window is None:
        rows = pairs // length
    else:  # the largest r with r * (r + window - 1) <= pairs
        rows = (math.isqrt((window - 1) ** 2 + 4 * pairs) - (window - 1)) // 2
    return max(1, min(length, rows))


def masked_attention(q, k, v, scale: float, first_query: int = 0, first_key: int = 0,
                     window: int | None = None, softcap: float | None = None,
                     sinks: torch.Tensor | None = None, chunk: int | None = None) -> torch.Tensor:
    """Queries at positions first_query.. against keys at first_key.. (q [seqs, heads, n, dim],
    k and v [seqs, kv_heads, m, dim]), causal and within `window`: SDPA with the mask, or,
    with `softcap` or `sinks` ([heads]), the scores written out (and capped), in float32 as is
    their softmax (with the sinks); with `chunk`, within each query's chunk."""
    query_pos = torch.arange(first_query, first_query + q.shape[2], device=q.device)
    key_pos = torch.arange(first_key, first_key + k.shape[2], device=q.device)
    mask = visible_keys(query_pos, key_pos, window, chunk)
    if softcap is None and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                              enable_gqa=q.shape[1] != k.shape[1])
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    if softcap is not None:
        scores = soft_cap(scores, softcap)
    weights = sink_softmax(scores.masked_fill(~mask, float("-inf")),
                           None if sinks is None else sinks.view(1, -1, 1, 1))
    return torch.matmul(weights.to(q.dtype), v)


def prefill_attention(q, k, v, scale: float, window: int | None = None,
                      softcap: float | None = None, sinks: torch.Tensor | None = None,
                      chunk: int | None = None):
    """Causal attention within each sequence: q [seqs, heads, len, dim], k and v [seqs, kv_heads,
    len, dim] -> [seqs, heads, len, dim]. Full attention without a cap or sinks is SDPA's
    causal kernel (memory linear in len); a window, a chunk (Llama 4), a cap or sinks go
    through `masked_attention`, its queries in
    chunks (`query_chunk`) when the scores would pass MAX_SCORE_BYTES, each chunk against the
    keys from the first one its earliest query sees (a window's start) to its own last query.
    (The bound is the module's, not an argument: each argument with a default adds guards to
    every compiled graph that inlines this function, which chapter 03 counts.)

    Compiled code takes the whole score tensor, as before: a loop over a length Dynamo keeps
    symbolic (the CPU's compiled prefill) would pin that length. The prefills that reach the
    bound (chapter 04's on a GPU) run eagerly."""
    if softcap is None and window is None and sinks is None and chunk is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                              enable_gqa=q.shape[1] != k.shape[1])
    length = q.shape[2]
    rows = length if torch.compiler.is_compiling() else query_chunk(
        q.shape[0], q.shape[1], length, window or chunk, MAX_SCORE_BYTES)
    if rows >= length:
        return masked_attention(q, k, v, scale, window=window, softcap=softcap, sinks=sinks,
                                chunk=chunk)
    chunks = []
    for start in range(0, length, rows):
        end = min(length, start + rows)
        first = earliest_key(start, window, chunk)
        chunks.append(masked_attention(q[:, :, start:end], k[:, :, first:end],
                                       v[:, :, first:end], scale, start, first, window, softcap,
                                       sinks, chunk))
    return torch.cat(chunks, dim=2)
