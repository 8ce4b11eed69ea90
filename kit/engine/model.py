"""A Llama/Gemma-family decoder in plain PyTorch (chapters 01, 03, 04).

RMSNorm, rotary position embeddings, grouped- or multi-query attention and a gated MLP, with
random weights drawn from a seed. `forward` runs prefill over a batch of equal-length
sequences (as vLLM's profiling run does) and returns hidden states; `compute_logits` is applied
to one position per sequence, as an engine's sampler does. `decode` runs one token per sequence
over the paged KV cache (chapter 04).

Attention is one method, `Attention.attend`. Without `AttentionMetadata` it is plain causal
attention within each sequence. With it, the layer first writes its keys and values into the
paged cache at `slot_mapping`; a prefill then attends as before, a decode step reads every
sequence's keys and values back through its block table (`block_tables`, `context_lens`).

Every product with a weight goes through `linear`, plain `F.linear` but in compiled code after
`Decoder.multiply_in(torch.float32)`: then 16-bit weights are multiplied in float32, for CPUs
whose oneDNN has no 16-bit kernels (chapter 04).
"""
from __future__ import annotations

import contextlib
import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from kit.config import ModelConfig
from kit.measure.device import torch_dtype


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, gemma: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps, self.gemma = eps, gemma

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        w = self.weight.float()
        # Gemma stores the scale as an offset from 1.
        return (xf * (1.0 + w if self.gemma else w)).to(x.dtype)


def llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3's RoPE scaling: wavelengths past the original context's are stretched by
    `factor`, those under it / high_freq_factor kept, and the band between interpolated."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    context = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > context / low, inv_freq / factor, inv_freq)
    smooth = (context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= context / high) & (wavelen <= context / low)
    return torch.where(medium, smoothed, scaled)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, scaling: tuple = ()):
    """cos and sin of shape [tokens, head_dim / 2] for the rotary embedding (`scaling`: Llama
    3's, as `ModelConfig.rope_scaling` holds it)."""
    inv_freq = 1.0 / theta ** (
        torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim)
    if scaling:
        inv_freq = llama3_inv_freq(inv_freq, dict(scaling))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    return freqs.cos(), freqs.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [tokens, heads, head_dim], rotating the two halves (the NeoX layout Llama uses)."""
    x1, x2 = x.float().chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def linear(x: torch.Tensor, weight: torch.Tensor, bias=None, matmul_dtype=None) -> torch.Tensor:
    """`F.linear`; in code being compiled with `matmul_dtype` given (`Decoder.multiply_in`),
    the product runs in that dtype and the result comes back in x's. With frozen weights the
    conversion folds into the constants, done once (eager code never converts: it would copy
    every weight on every call)."""
    if matmul_dtype is None or matmul_dtype == weight.dtype or not torch.compiler.is_compiling():
        return F.linear(x, weight, bias)
    return F.linear(x.to(matmul_dtype), weight.to(matmul_dtype),
                    None if bias is None else bias.to(matmul_dtype)).to(x.dtype)


class Linear(nn.Linear):
    """`nn.Linear` through `linear`: compiled, its product may run in `matmul_dtype`."""

    matmul_dtype: torch.dtype | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.matmul_dtype)


class AttentionMetadata(NamedTuple):
    """Where a forward's keys and values go in the paged cache, and (decode) where to read them.

    kv_cache:        [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
                     (engine.kv_cache)
    slot_mapping:    [tokens] flat slot (block × block_size + offset) of each token's K and V
    block_tables:    [num_seqs, max_blocks] block ids per sequence, padded; None for a prefill
    context_lens:    [num_seqs] tokens each sequence attends to (its new token included)
    max_context_len: positions a decode step reads per sequence, fixed for the batch (its
                     longest context, `attention_span`); None: the table's whole width

    A NamedTuple, so torch.compile traces it without guarding on Python state but the one int,
    which stays the same for a batch (vLLM's attention metadata carries `max_seq_len` too).
    """

    kv_cache: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor | None = None
    context_lens: torch.Tensor | None = None
    max_context_len: int | None = None


def write_kv(kv_cache: torch.Tensor, layer_idx: int, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store one layer's new keys and values ([tokens, kv_heads, head_dim]) at their slots.

    One `index_put_` on the whole cache, indexed by (layer, K or V, block, offset): compiled,
    that is an in-place scatter of just these rows. Written through a view instead (one
    layer's cache, or the cache flattened), Inductor copied the whole cache on every step."""
    block_size = kv_cache.shape[3]
    block, offset = slot_mapping // block_size, slot_mapping % block_size
    layer = torch.full_like(slot_mapping, layer_idx)
    kind = torch.cat([torch.zeros_like(slot_mapping), torch.ones_like(slot_mapping)])
    kv_cache.index_put_((torch.cat([layer, layer]), kind, torch.cat([block, block]),
                         torch.cat([offset, offset])), torch.cat([k, v]))


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
# side, keep the CPU's vector units busy (the README gives the times seen).
VALUE_CHUNK = 16


def attention_span(longest_context: int, table_positions: int) -> int:
    """Positions a decode step's attention reads per sequence: the batch's longest context
    rounded up to whole VALUE_CHUNKs, within the table's positions (width × block_size)."""
    return min(-(-longest_context // VALUE_CHUNK) * VALUE_CHUNK, table_positions)


def weighted_values(weights: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Σ over positions of weights [seqs, kv_heads, group, len] × values [seqs, len, kv_heads,
    dim] -> [seqs, kv_heads, group, dim], as summed products in float32, by VALUE_CHUNKs of
    positions where the length divides into them."""
    num_seqs, length, kv_heads, head_dim = v.shape
    v = v.permute(0, 2, 1, 3)[:, :, None].float()  # [seqs, kv_heads, 1, len, dim]
    if length % VALUE_CHUNK:
        return (weights[..., None] * v).sum(-2)
    chunks = (num_seqs, kv_heads, -1, length // VALUE_CHUNK, VALUE_CHUNK)
    products = weights.reshape(chunks)[..., None] * v.reshape(*chunks, head_dim)
    return products.sum(-2).sum(-2)


def paged_decode_attention(q: torch.Tensor, layer_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor,
                           max_context_len: int | None = None):
    """One query token per sequence ([seqs, heads, head_dim]) against its cached context.

    Keys and values are gathered through the block table, the first `max_context_len`
    positions of each sequence's table (all of them by default): every shape depends only on
    the batch, never on the contexts' lengths, so one compiled graph (or one CUDA graph) serves
    every step. Positions past a sequence's context (the padding of its last block, or of its
    table) are masked out; the softmax runs in float32.
    """
    num_seqs, width = block_tables.shape
    _, _, block_size, kv_heads, head_dim = layer_cache.shape
    length, group = max_context_len or width * block_size, q.shape[1] // kv_heads
    k = layer_cache[0][block_tables].view(num_seqs, -1, kv_heads, head_dim)[:, :length]
    v = layer_cache[1][block_tables].view(num_seqs, -1, kv_heads, head_dim)[:, :length]
    visible = torch.arange(length, device=q.device)[None, :] < context_lens[:, None]
    # The same arithmetic written two ways (the branch is taken once, while tracing): run
    # eagerly, two matmuls; compiled, products summed over [seqs, kv_heads, group, len, dim],
    # which Inductor turns into one kernel that gathers through the table as it goes (faster
    # than compiled matmuls; the README gives the times seen). `summed_attention` sums eagerly too.
    summed = summed_form()
    if summed:
        qg = q.view(num_seqs, kv_heads, group, 1, head_dim).float()
        scores = (qg * k.permute(0, 2, 1, 3)[:, :, None].float()).sum(-1)
    else:  # queries of one KV head side by side: [seqs, kv_heads, group, head_dim]
        scores = torch.matmul(q.view(num_seqs, kv_heads, group, head_dim),
                              k.permute(0, 2, 3, 1)).float()
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))  # [s, kvh, g, len]
    weights = (scores * head_dim ** -0.5).softmax(-1)
    if summed:
        out = weighted_values(weights, v)
    else:
        out = torch.matmul(weights.to(q.dtype), v.transpose(1, 2))
    return out.to(q.dtype).reshape(q.shape)


class Attention(nn.Module):
    def __init__(self, arch: ModelConfig, layer_idx: int = 0):
        super().__init__()
        self.layer_idx = layer_idx  # which slice of the KV cache is this layer's
        self.num_heads, self.num_kv_heads = arch.num_attention_heads, arch.num_key_value_heads
        self.head_dim = arch.head_dim
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.split = (q, kv, kv)
        # Q, K and V in one matrix, as vLLM's QKVParallelLinear holds them: one product per
        # layer instead of three, which streams the weights faster at a decode batch.
        self.qkv_proj = Linear(arch.hidden_size, q + 2 * kv, bias=arch.attention_bias)
        self.o_proj = Linear(q, arch.hidden_size, bias=False)

    def forward(self, x, cos, sin, num_seqs: int, meta: AttentionMetadata | None = None):
        tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.split, dim=-1)
        q = apply_rope(q.view(tokens, self.num_heads, self.head_dim), cos, sin)
        k = apply_rope(k.view(tokens, self.num_kv_heads, self.head_dim), cos, sin)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        out = self.attend(q, k, v, num_seqs, meta)
        return self.o_proj(out.reshape(tokens, self.num_heads * self.head_dim))

    def attend(self, q, k, v, num_seqs: int, meta: AttentionMetadata | None = None):
        """Causal attention within each of `num_seqs` equal-length sequences; with `meta`, the
        keys and values are also written to the paged cache, and a decode step (one token per
        sequence, `meta.block_tables` given) reads its whole context back from there."""
        if meta is not None:
            write_kv(meta.kv_cache, self.layer_idx, k, v, meta.slot_mapping)
            if meta.block_tables is not None:
                return paged_decode_attention(q, meta.kv_cache[self.layer_idx],
                                              meta.block_tables, meta.context_lens,
                                              meta.max_context_len)

        def per_seq(t):  # [tokens, heads, dim] -> [seqs, heads, len, dim]
            return t.view(num_seqs, -1, t.shape[1], self.head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(
            per_seq(q), per_seq(k), per_seq(v), is_causal=True,
            enable_gqa=self.num_heads != self.num_kv_heads)
        return out.transpose(1, 2).reshape(q.shape)


class MLP(nn.Module):
    def __init__(self, arch: ModelConfig):
        super().__init__()
        # The gate and up projections in one matrix (vLLM's MergedColumnParallelLinear).
        self.gate_up_proj = Linear(arch.hidden_size, 2 * arch.intermediate_size, bias=False)
        self.down_proj = Linear(arch.intermediate_size, arch.hidden_size, bias=False)
        self.gelu = arch.hidden_act != "silu"
        # "gelu" is the exact (erf) GELU in transformers; the others are the tanh approximation
        self.approximate = "none" if arch.hidden_act == "gelu" else "tanh"

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        gate = F.gelu(gate, approximate=self.approximate) if self.gelu else F.silu(gate)
        return self.down_proj(gate * up)


class DecoderLayer(nn.Module):
    def __init__(self, arch: ModelConfig, layer_idx: int = 0):
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, arch.gemma_norm)
        self.self_attn = Attention(arch, layer_idx)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps,
                                                arch.gemma_norm)
        self.mlp = MLP(arch)

    def forward(self, x, cos, sin, num_seqs: int, meta: AttentionMetadata | None = None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, num_seqs, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    """The whole model. Build it with `build_model`, which places and initializes the weights."""

    matmul_dtype: torch.dtype | None = None  # compiled code's products (`multiply_in`)

    def __init__(self, arch: ModelConfig):
        super().__init__()
        self.arch = arch
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(arch, i) for i in range(arch.num_hidden_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, arch.gemma_norm)
        self.lm_head = None if arch.tie_word_embeddings else \
            Linear(arch.hidden_size, arch.vocab_size, bias=False)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        if self.arch.gemma_norm:  # Gemma scales embeddings by sqrt(hidden_size), in the model dtype
            x = x * self.arch.hidden_size ** 0.5
        return x

    def forward(self, input_ids: torch.Tensor,
                meta: AttentionMetadata | None = None) -> torch.Tensor:
        """Prefill. input_ids: [num_seqs, seq_len] -> hidden states [num_seqs, seq_len, hidden].
        With `meta` (its slot_mapping covering every token), the keys and values also go to
        the paged cache."""
        num_seqs, seq_len = input_ids.shape
        positions = torch.arange(seq_len, device=input_ids.device).repeat(num_seqs)
        hidden = self.run_layers(input_ids.reshape(-1), positions, num_seqs, meta)
        return hidden.view(num_seqs, seq_len, -1)

    def decode(self, input_ids: torch.Tensor, positions: torch.Tensor,
               meta: AttentionMetadata) -> torch.Tensor:
        """One decode step: one new token per sequence at `positions` ([num_seqs] each), its
        attention reading the context through `meta`'s block tables -> [num_seqs, hidden]."""
        return self.run_layers(input_ids, positions, input_ids.shape[0], meta)

    def run_layers(self, input_ids, positions, num_seqs: int, meta=None) -> torch.Tensor:
        """Flat tokens [tokens] at `positions` [tokens] through every layer and the final norm."""
        cos, sin = rope_cos_sin(positions, self.arch.head_dim, self.arch.rope_theta,
                                self.arch.rope_scaling)
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x, cos, sin, num_seqs, meta)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return linear(hidden, weight, matmul_dtype=self.matmul_dtype)

    def multiply_in(self, dtype: torch.dtype | None) -> None:
        """Compiled code runs every product with the weights in `dtype` (None: the weights'
        own). On a CPU whose oneDNN has no bf16 kernels (x86 without AVX-512), a bf16 product
        is emulated several times slower than a float32 one: there the decode runners
        multiply 16-bit weights in float32 (`kit.engine.decode.compiled_matmul_dtype`); the
        products of 16-bit numbers are exact in float32, so only the result's rounding to
        the model's dtype remains, as in a native 16-bit product. Eager code is unchanged."""
        self.matmul_dtype = dtype
        for module in self.modules():
            if isinstance(module, Linear):
                module.matmul_dtype = dtype


@torch.no_grad()
def init_weights(model: nn.Module, seed: int) -> None:
    """Random weights from `seed`, the same on every run of the same device."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, p in sorted(model.named_parameters()):
        if name.endswith("norm.weight"):
            p.fill_(0.0 if model.arch.gemma_norm else 1.0)
        elif name.endswith(".bias"):
            p.zero_()
        else:
            p.normal_(0.0, 0.02, generator=gen)


def build_model(arch: ModelConfig, dtype: str, device: str, seed: int = 0) -> Decoder:
    """Allocate the weights directly on `device` in `dtype` (no fp32 copy), then draw them
    from `seed`, or read them from `arch.checkpoint` when the model is a checkpoint folder."""
    if arch.checkpoint:  # a bad folder is refused before the weights are allocated
        from kit.engine.checkpoint import check_checkpoint, load_checkpoint
        check_checkpoint(arch)
    with torch.device("meta"):
        model = Decoder(arch).to(torch_dtype(dtype))
    model = model.to_empty(device=device)
    if arch.checkpoint:
        load_checkpoint(model, arch)
    else:
        init_weights(model, seed)
    return model.eval().requires_grad_(False)


def weights_bytes(model: nn.Module) -> int:
    """Parameter bytes, each shared tensor counted once."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def dummy_batch(num_tokens: int, max_num_seqs: int, vocab_size: int, device: str, seed: int = 0):
    """Token ids [num_seqs, seq_len] holding exactly `num_tokens` tokens, in as many equal
    sequences as possible up to `max_num_seqs` (vLLM's profiling run also splits its tokens
    over up to max_num_seqs requests)."""
    num_seqs = max(d for d in range(1, min(max_num_seqs, num_tokens) + 1) if num_tokens % d == 0)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (num_seqs, num_tokens // num_seqs), generator=gen)
    return ids.to(device)
