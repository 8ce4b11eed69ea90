"""What one layer keeps in the KV cache (chapter 02): a spec per layer, as vLLM 0.32's
`vllm/v1/kv_cache_interface.py` has them. No torch here.

Every spec answers the same questions, in vLLM's names:

    page_size_bytes            one layer's block: what one block id costs in this layer
    max_memory_usage_bytes     what one request of max_model_len tokens reserves in this layer
    num_skipped_tokens         tokens the next token no longer sees (their blocks can go back)
    bytes_per_token            what the layer stores for each token it keeps
    tokens_read                cached tokens a decode step reads for a context of n tokens

A kind of layer is one class here (full attention, a sliding window, Llama 4's chunked local
attention, DeepSeek's latent attention, the recurrent state of a Mamba-2 or gated delta-net
layer; layers sharing another's cache have none): the groups (`kit.engine.kv_groups`), the cache (`kit.engine.kv_cache`), the block tables
(`kit.engine.block_manager`) and the roofline ask the spec, never the model config.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace


@dataclass(frozen=True)
class KVCacheSpec:
    """One layer's cache, paged in blocks of `block_size` tokens (vLLM's `KVCacheSpec`)."""

    block_size: int
    recycles = False  # hands blocks back before its sequence ends (a window, a chunk)

    @property
    def bytes_per_token(self) -> int:
        raise NotImplementedError

    @property
    def page_size_bytes(self) -> int:
        """One block of this layer: block_size tokens."""
        return self.block_size * self.bytes_per_token

    def max_memory_usage_bytes(self, max_model_len: int, in_flight_tokens: int) -> int:
        raise NotImplementedError

    def blocks_per_request(self, max_model_len: int, in_flight_tokens: int) -> int:
        """Block ids one request of max_model_len tokens reserves in this layer's group."""
        return math.ceil(self.max_memory_usage_bytes(max_model_len, in_flight_tokens)
                         / self.page_size_bytes)

    def num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Tokens the next token's attention skips: none, unless the layer forgets."""
        return 0

    def blocks_for_tokens(self, num_tokens: int) -> int:
        """Blocks a sequence of `num_tokens` tokens holds in this layer's group (before any
        go back)."""
        return math.ceil(num_tokens / self.block_size)

    def admission_blocks(self, num_tokens: int, max_model_len: int,
                         in_flight_tokens: int) -> int:
        """Blocks a new request of `num_tokens` must find free in this layer's group to be
        admitted (`get_num_blocks_to_allocate` with `apply_admission_cap`): its blocks, and
        for a layer that hands blocks back as it goes (`recycles`) no more than a request
        reserves (`max_admission_blocks_per_request`, the start-up sizing's own count)."""
        blocks = self.blocks_for_tokens(num_tokens)
        if self.recycles:
            return min(blocks, self.blocks_per_request(max_model_len, in_flight_tokens))
        return blocks

    def tokens_read(self, context_len: int) -> int:
        """Tokens a decode step attends to, of a context of `context_len` (its new one in)."""
        return context_len

    def describe(self) -> str:
        raise NotImplementedError


@dataclass(frozen=True)
class AttentionSpec(KVCacheSpec):
    """A layer that keeps a key and a value per KV head for every token (vLLM's
    `AttentionSpec`): 2 × num_kv_heads × head_size × dtype bytes a token."""

    num_kv_heads: int
    head_size: int
    dtype_bytes: int
    # a page padded to another layer's larger one it does not divide (`unify_page_sizes`)
    page_size_padded: int | None = field(default=None, kw_only=True)

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_kv_heads * self.head_size * self.dtype_bytes

    @property
    def page_size_bytes(self) -> int:
        return self.page_size_padded or self.block_size * self.bytes_per_token

    def page_formula(self) -> str:
        """One layer's block written out."""
        return (f"2 × {self.num_kv_heads} KV heads × {self.head_size} head_dim × "
                f"{self.dtype_bytes} B × {self.block_size} tokens")


@dataclass(frozen=True)
class FullAttentionSpec(AttentionSpec):
    """Attends to every earlier token: a request reserves blocks for max_model_len tokens."""

    sliding_window = None

    def max_memory_usage_bytes(self, max_model_len: int, in_flight_tokens: int) -> int:
        return math.ceil(max_model_len / self.block_size) * self.page_size_bytes

    def describe(self) -> str:
        return "full attention"


@dataclass(frozen=True)
class SlidingWindowSpec(AttentionSpec):
    """Attends to the last `sliding_window` tokens (itself included). A request reserves what a
    step can still attend to plus what it writes, min(W − 1 + in-flight tokens,
    max_model_len), in blocks, and one block more for a window that straddles a block edge
    (`SlidingWindowSpec.max_memory_usage_bytes`); `in_flight_tokens` is
    max_num_batched_tokens per step in flight (`kit.engine.kv_cache.in_flight_tokens`)."""

    recycles = True

    sliding_window: int

    def max_memory_usage_bytes(self, max_model_len: int, in_flight_tokens: int) -> int:
        if in_flight_tokens < 1:
            raise ValueError("a sliding window's reservation needs in_flight_tokens")
        tokens = min(self.sliding_window - 1 + in_flight_tokens, max_model_len)
        return (math.ceil(tokens / self.block_size) + 1) * self.page_size_bytes

    def num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """All but the last window − 1 computed tokens (`get_num_skipped_tokens`)."""
        return max(0, num_computed_tokens - self.sliding_window + 1)

    def tokens_read(self, context_len: int) -> int:
        return min(context_len, self.sliding_window)

    def describe(self) -> str:
        return f"window {self.sliding_window:,}"


@dataclass(frozen=True)
class ChunkedLocalAttentionSpec(AttentionSpec):
    """Attends to the earlier tokens of its own chunk of `attention_chunk_size` positions
    (Llama 4's RoPE layers). A request reserves a chunk plus what it writes, min(C + in-flight
    tokens, max_model_len), in blocks (`max_admission_blocks_per_request`: no block more, as
    a chunk starts at a multiple of C, not mid-window)."""

    attention_chunk_size: int
    sliding_window = None
    recycles = True

    def max_memory_usage_bytes(self, max_model_len: int, in_flight_tokens: int) -> int:
        tokens = min(self.attention_chunk_size + in_flight_tokens, max_model_len)
        return math.ceil(tokens / self.block_size) * self.page_size_bytes

    def num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """The tokens of the chunks before the next token's (`ChunkedLocalAttentionManager.
        get_num_skipped_tokens`): 8 after 13 computed tokens in chunks of 8."""
        return num_computed_tokens // self.attention_chunk_size * self.attention_chunk_size

    def tokens_read(self, context_len: int) -> int:
        return context_len - (context_len - 1) // self.attention_chunk_size \
            * self.attention_chunk_size

    def describe(self) -> str:
        return f"chunk {self.attention_chunk_size:,}"


@dataclass(frozen=True)
class MLAAttentionSpec(FullAttentionSpec):
    """Multi-head latent attention (DeepSeek V2/V3, Kimi K2): every token keeps one compressed
    latent of kv_lora_rank elements and one rotary key of qk_rope_head_dim, shared by all
    heads, and no V of its own (vLLM's `MLAAttentionSpec`: one "head" of head_size =
    kv_lora_rank + qk_rope_head_dim, `head_size_v` 0): head_size × dtype bytes a token."""

    @property
    def bytes_per_token(self) -> int:
        return self.num_kv_heads * self.head_size * self.dtype_bytes

    def describe(self) -> str:
        return "latent attention"

    def page_formula(self) -> str:
        return (f"1 latent of {self.head_size} (kv_lora_rank + qk_rope_head_dim) × "
                f"{self.dtype_bytes} B × {self.block_size} tokens")


@dataclass(frozen=True)
class MambaSpec(KVCacheSpec):
    """A recurrent layer (Mamba-2, a gated delta-net): a fixed state per request, whatever
    its length, a convolution's last inputs and the temporal state (vLLM's `MambaSpec`;
    `state_bytes`: both, one request, one rank). Its page is one state, padded to the
    attention layers' page in a hybrid (`kit.engine.hybrid_cache.align_hybrid`). With prefix
    caching (vLLM's `mamba_cache_mode` "align") a request holds 2 states, the running one and
    the last block boundary's, plus `checkpoint_blocks` (Mamba-2 keeps one more for its
    prefill); without ("none") it holds 1. Nothing grows with the tokens: bytes_per_token 0."""

    state_bytes: int
    kind: str = "mamba2"          # "mamba2" or "gated_delta_net"
    cache_mode: str = "align"     # "align" with prefix caching, else "none"
    checkpoint_blocks: int = 0
    page_size_padded: int | None = field(default=None, kw_only=True)
    # one state's two tensors as a run keeps them (vLLM's `MambaSpec.shapes` and `dtypes`):
    # the convolution's [conv_dim, conv_kernel - 1] and the SSM's [heads, head_dim, d_state]
    # (a delta-net's [value heads, value head dim, key head dim]), each in its dtype
    shapes: tuple = field(default=(), kw_only=True)
    dtypes: tuple = field(default=(), kw_only=True)
    sliding_window = None

    @property
    def bytes_per_token(self) -> int:
        return 0

    @property
    def page_size_bytes(self) -> int:
        return self.page_size_padded or self.state_bytes

    @property
    def states_per_request(self) -> int:
        return 2 + self.checkpoint_blocks if self.cache_mode == "align" else 1

    def max_memory_usage_bytes(self, max_model_len: int, in_flight_tokens: int) -> int:
        return self.states_per_request * self.page_size_bytes

    def tokens_read(self, context_len: int) -> int:
        return 0

    def blocks_for_tokens(self, num_tokens: int) -> int:
        """One block, whatever the length: the state's (a run without prefix caching keeps
        one state per request, as vLLM's `mamba_cache_mode` "none" does)."""
        return 1 if num_tokens else 0

    def describe(self) -> str:
        return {"mamba2": "Mamba-2 state", "gated_delta_net": "gated delta-net state"}[self.kind]

    def page_formula(self) -> str:
        padded = f", padded to {self.page_size_bytes:,} B" if self.page_size_padded else ""
        return f"one state of {self.state_bytes:,} B{padded}"


def attention_spec(window: int | None, block_size: int, num_kv_heads: int, head_size: int,
                   dtype_bytes: int, chunk: int | None = None) -> AttentionSpec:
    """One layer's spec: a chunk's of `chunk` positions (Llama 4), a sliding window's of
    `window` tokens, or full attention's (both None)."""
    shape = {"block_size": block_size, "num_kv_heads": num_kv_heads, "head_size": head_size,
             "dtype_bytes": dtype_bytes}
    if chunk:
        return ChunkedLocalAttentionSpec(**shape, attention_chunk_size=chunk)
    return FullAttentionSpec(**shape) if window is None else \
        SlidingWindowSpec(**shape, sliding_window=window)


def attention_specs(windows, block_size: int, num_kv_heads: int, head_size: int,
                    dtype_bytes: int, chunks=None) -> tuple[AttentionSpec, ...]:
    """A spec per layer, for layers whose windows are `windows` (None: full attention) and
    whose chunks are `chunks` (None, or None for a layer: not chunked)."""
    chunks = chunks or [None] * len(windows)
    return tuple(attention_spec(w, block_size, num_kv_heads, head_size, dtype_bytes, c)
                 for w, c in zip(windows, chunks))


def unify_page_sizes(specs: tuple[AttentionSpec, ...]) -> tuple[AttentionSpec, ...]:
    """Every layer's page made the largest one, as vLLM makes one pool of block ids
    (`unify_kv_cache_spec_page_size`): a smaller page that divides it takes proportionally
    more tokens per block (Gemma 4's sliding layers, with heads half the global ones', run at
    twice the block size), one that does not is padded to it."""
    largest = max(s.page_size_bytes for s in specs)

    def unified(spec):
        if spec.page_size_bytes == largest:
            return spec
        if largest % spec.page_size_bytes == 0:
            return replace(spec, block_size=spec.block_size * largest // spec.page_size_bytes)
        return replace(spec, page_size_padded=largest)
    return tuple(map(unified, specs))
