"""Qwen3-Next's gated delta-net (chapters 01, 04, 05): a recurrent layer that keeps, per
request, a convolution state and a state matrix per value head in place of keys and values
per token (vLLM's `MambaSpec`, `kit.config.cache_kinds.Recurrent`).

    project   in_proj_qkvz(x) -> q, k (key heads × key dim), v, z (value heads × value dim);
              in_proj_ba(x) -> b, a (one per value head). Qwen3-Next stores both grouped per
              key head: each key head's q, k, then its value heads' v and z (and b, a), as
              transformers' `fix_query_key_value_ordering` and vLLM's
              `Qwen3NextGatedDeltaNet.fix_query_key_value_ordering` regroup them; Qwen3.5
              stores them apart (in_proj_qkv: all q, k, v; in_proj_z; in_proj_b; in_proj_a),
              which the kit stacks as vLLM does (`Qwen3_5Model`'s loader, vLLM's
              `gqa_interleaved_layout=False`): [q, k, v, z] and [b, a], no regrouping
    convolve  [q, k, v] through a causal depthwise convolution of conv_kernel taps, then SiLU;
              its state: each request's last conv_kernel - 1 inputs
    gates     beta = sigmoid(b); g = -exp(A_log) · softplus(a + dt_bias) (float32)
    heads     q and k L2-normed (eps 1e-6), q scaled by key_dim^-1/2; each key head serves
              value_heads / key_heads value heads
    recur     per value head and token, the state S [value dim, key dim] (vLLM's layout):
                  S <- S · exp(g)
                  S <- S + beta · (v - S k) ⊗ k          (the delta rule)
                  out = S q
    output    RMSNorm(out) × its weight × SiLU(z) per value head (`HeadGatedNorm`), out_proj

A prefill runs the recurrence by chunks of 64 tokens (`chunked_delta_rule`, one opaque operator
in compiled code: `opaque_chunked_delta_rule`; transformers'
`torch_chunk_gated_delta_rule`, the arithmetic of vLLM's `chunk_gated_delta_rule` kernels):
within a chunk the updates are condensed into a triangular solve and a few matrix products,
across chunks the state is carried. A decode step runs it once (`delta_rule`: transformers'
`torch_recurrent_gated_delta_rule`, vLLM's `fused_recurrent_gated_delta_rule`), from the
request's state, which it updates in place; its convolution likewise (`conv_step`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kit.engine.layers.linear import Linear
from kit.engine.layers.state_slots import state_slots, write_state


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x over its last dim divided by its L2 norm, float32 (transformers' `l2norm`, FLA's)."""
    x = x.float()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def causal_conv(x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A prefill's convolution from a zero state: x [seqs, len, channels], weight [channels,
    taps] -> (SiLU of the causal depthwise convolution [seqs, len, channels], the state each
    sequence leaves: its last taps - 1 inputs [seqs, channels, taps - 1], zeros before its
    first)."""
    taps = weight.shape[-1]
    xt = x.transpose(1, 2)
    out = F.conv1d(xt.float(), weight.float()[:, None], padding=taps - 1,
                   groups=weight.shape[0])[..., :x.shape[1]]
    state = F.pad(xt, (max(taps - 1 - x.shape[1], 0), 0))[..., -(taps - 1):]
    return F.silu(out).to(x.dtype).transpose(1, 2), state


def conv_step(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """One token per sequence, x [seqs, channels], through the convolution from `conv_state`
    [seqs, channels, taps - 1], which moves on by the token in place -> SiLU of the output
    [seqs, channels] (transformers' `causal_conv1d_update`)."""
    window = torch.cat([conv_state, x[..., None].to(conv_state.dtype)], dim=-1)
    conv_state.copy_(window[..., 1:])
    out = (window.float() * weight.float()).sum(-1)
    return F.silu(out).to(x.dtype)


def delta_rule(q, k, v, g, beta, state: torch.Tensor) -> torch.Tensor:
    """The recurrence token by token: q, k [seqs, len, heads, key_dim] (L2-normed), v [seqs,
    len, heads, value_dim], g, beta [seqs, len, heads], from `state` [seqs, heads, value_dim,
    key_dim], which ends holding the last token's (in place) -> out [seqs, len, heads,
    value_dim] in v's dtype, computed in float32."""
    q = q.float() * q.shape[-1] ** -0.5
    s, outs = state.float(), []
    for t in range(q.shape[1]):
        s = s * g[:, t, :, None, None].float().exp()
        kt = k[:, t, :, None, :].float()
        delta = (v[:, t].float() - (s * kt).sum(-1)) * beta[:, t, :, None].float()
        s = s + delta[..., None] * kt
        outs.append((s * q[:, t, :, None, :]).sum(-1))
    state.copy_(s)
    return torch.stack(outs, dim=1).to(v.dtype)


def chunked_delta_rule(q, k, v, g, beta, chunk: int = 64, state: torch.Tensor | None = None):
    """The recurrence by chunks of `chunk` tokens (shapes as `delta_rule`; `state` None: zero)
    -> (out [seqs, len, heads, value_dim] in v's dtype, the final state [seqs, heads,
    value_dim, key_dim] float32). Within a chunk, with c the cumulative sum of g and
    D[i, j] = exp(c_i - c_j) for j ≤ i, the chunk's corrections u solve
    (I + tril(βK Kᵀ ⊙ D, -1)) u = βV - (the same solve of βK exp(c)) S, and
    out = (Q exp(c)) S + (Q Kᵀ ⊙ D) u, S <- S exp(c_last) + (K exp(c_last - c))ᵀ u."""
    seqs, length, heads, key_dim = k.shape
    value_dim, dtype = v.shape[-1], v.dtype
    q, k, v, g, beta = (t.transpose(1, 2).float() for t in (q, k, v, g, beta))
    q = q * key_dim ** -0.5
    n = (length + chunk - 1) // chunk  # chunks: padded to n·chunk, never `-length % chunk`
    pad = n * chunk - length
    q, k, v = (F.pad(t, (0, 0, 0, pad)).unflatten(2, (n, chunk)) for t in (q, k, v))
    g, beta = (F.pad(t, (0, pad)).unflatten(2, (n, chunk)) for t in (g, beta))
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    c = g.cumsum(-1)
    later = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    decay = (c[..., :, None] - c[..., None, :]).masked_fill(later, float("-inf")).exp()
    system = (k_beta @ k.transpose(-1, -2)) * decay  # solved as unit lower triangular
    u = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, k_beta * c.exp()[..., None], upper=False,
                                      unitriangular=True)
    within = (q @ k.transpose(-1, -2)) * decay
    q_decayed = q * c.exp()[..., None]
    k_decayed = k * (c[..., -1:] - c).exp()[..., None]
    s = q.new_zeros(seqs, heads, key_dim, value_dim) if state is None \
        else state.float().transpose(-1, -2)
    outs = []
    for i in range(n):
        corrections = u[:, :, i] - w[:, :, i] @ s
        outs.append(q_decayed[:, :, i] @ s + within[:, :, i] @ corrections)
        s = s * c[:, :, i, -1, None, None].exp() + k_decayed[:, :, i].transpose(-1, -2) \
            @ corrections
    out = torch.stack(outs, dim=2).flatten(2, 3)[:, :, :length]
    return out.transpose(1, 2).to(dtype), s.transpose(-1, -2)


@torch.library.custom_op("kit::chunked_delta_rule", mutates_args=())
def opaque_chunked_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                              beta: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`chunked_delta_rule` from zero states as one operator, which a compiled prefill calls
    without tracing into it (as vLLM's graph calls its delta-net, `vllm::qwen_gdn_attention_core`,
    one of its CompilationConfig's splitting ops). Traced, its Python loop over chunks fixed
    the number of chunks in the graph (a guard-free prefill compiled on prompts of up to 64
    tokens failed on 70), and the symbolic padding slowed the compile; eager, it is
    `chunked_delta_rule` itself."""
    out, state = chunked_delta_rule(q, k, v, g, beta, chunk)
    return out.contiguous(), state.contiguous()


@opaque_chunked_delta_rule.register_fake
def _(q, k, v, g, beta, chunk):
    seqs, length, heads, value_dim = v.shape
    return v.new_empty(seqs, length, heads, value_dim), \
        v.new_empty(seqs, heads, value_dim, k.shape[-1], dtype=torch.float32)


class HeadGatedNorm(nn.Module):
    """RMSNorm of each value head's output (float32), times its weight (stored as is, not as
    an offset from 1), times SiLU(z) (transformers' `Qwen3NextRMSNormGated`)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return (self.weight * normed * F.silu(z.float())).to(x.dtype)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        self.weight.fill_(1.0)


class GatedDeltaNet(nn.Module):
    """The layer under its checkpoint names (in_proj_qkvz, in_proj_ba, conv1d, dt_bias,
    A_log, norm, out_proj); `prefill` from zero states, `step` from a request's states."""

    def __init__(self, arch, layer_idx: int = 0):
        super().__init__()
        r = arch.recurrent
        self.layer_idx = layer_idx
        self.key_heads, self.key_dim = r.groups, r.state_dim
        self.value_heads, self.value_dim = r.heads, r.head_dim
        self.per_key = r.heads // r.groups
        self.grouped = arch.parts.delta_projections == "grouped"  # (Qwen3.5: [q, k, v, z], [b, a])
        keys, values = self.key_heads * self.key_dim, self.value_heads * self.value_dim
        self.conv_dim = 2 * keys + values
        h = arch.hidden_size
        self.in_proj_qkvz = Linear(h, 2 * keys + 2 * values, bias=False)
        self.in_proj_ba = Linear(h, 2 * self.value_heads, bias=False)
        self.conv1d = nn.Parameter(torch.empty(self.conv_dim, 1, r.conv_kernel))  # as stored
        self.dt_bias = nn.Parameter(torch.empty(self.value_heads))
        self.A_log = nn.Parameter(torch.empty(self.value_heads))
        self.norm = HeadGatedNorm(self.value_dim, arch.rms_norm_eps)
        self.out_proj = Linear(values, h, bias=False)
        self.state_group = self.place = self.block_size = None  # set by `bind_kv_cache`

    def bind_kv_cache(self, layout) -> None:
        """This layer's recurrent group (whose block holds a sequence's states), its place
        (which row of the states' tensors) and the block size: plain numbers."""
        self.state_group, self.place = layout.place(self.layer_idx)
        self.block_size = layout.block_size

    def forward(self, x, cos, sin, num_seqs: int, meta=None, handed_on=None):
        """x [tokens, hidden] (`num_seqs` sequences of equal length, or one token each in a
        decode step, `meta.block_tables` given) -> [tokens, hidden]; RoPE's cos and sin
        unused. With `meta.states`, a prefill writes each sequence's final states to its slot
        (`kit.engine.layers.state_slots`) and a decode step moves them on there."""
        if meta is None or meta.states is None:
            return self.prefill(x, num_seqs)[0]
        if self.state_group is None:
            raise RuntimeError("the model's layers have no state slots: call "
                               "model.bind_kv_cache(layout) before a paged forward")
        slots = state_slots(meta, self.state_group, self.block_size, num_seqs)
        conv, ssm = meta.states.conv[self.place], meta.states.ssm[self.place]
        if meta.block_tables is not None:
            conv_state, state = conv[slots], ssm[slots]  # (copies, written back below)
            out = self.step(x, conv_state, state)
        else:
            out, conv_state, state = self.prefill(x, num_seqs)
        write_state(meta.states.conv, self.place, slots, conv_state)
        write_state(meta.states.ssm, self.place, slots, state)
        return out

    def project(self, x: torch.Tensor):
        """x [tokens, hidden] -> the convolution's input [q, k, v] [tokens, conv_dim], z
        [tokens, value heads, value_dim], b and a [tokens, value heads], regrouped from the
        projections' per-key-head order where `grouped`."""
        tokens = x.shape[0]
        if not self.grouped:
            keys, values = self.key_heads * self.key_dim, self.value_heads * self.value_dim
            mixed, z = self.in_proj_qkvz(x).split([2 * keys + values, values], dim=-1)
            b, a = self.in_proj_ba(x).chunk(2, dim=-1)
            return mixed, z.view(tokens, self.value_heads, self.value_dim), b, a
        per_group = self.in_proj_qkvz(x).view(tokens, self.key_heads, -1)
        q, k, v, z = per_group.split([self.key_dim, self.key_dim, self.per_key * self.value_dim,
                                      self.per_key * self.value_dim], dim=-1)
        b, a = self.in_proj_ba(x).view(tokens, self.key_heads, -1).chunk(2, dim=-1)
        mixed = torch.cat([q.reshape(tokens, -1), k.reshape(tokens, -1),
                           v.reshape(tokens, -1)], dim=-1)
        return (mixed, z.reshape(tokens, self.value_heads, self.value_dim),
                b.reshape(tokens, -1), a.reshape(tokens, -1))

    def heads(self, mixed: torch.Tensor, b: torch.Tensor, a: torch.Tensor):
        """The convolved [q, k, v] [..., conv_dim] and b, a [..., value heads] -> q, k
        (L2-normed, repeated per value head), v [..., heads, dim], g and beta (float32)."""
        keys = self.key_heads * self.key_dim
        q, k, v = mixed.split([keys, keys, self.value_heads * self.value_dim], dim=-1)
        q, k = (l2_normalize(t.unflatten(-1, (self.key_heads, self.key_dim)))
                .repeat_interleave(self.per_key, dim=-2) for t in (q, k))
        v = v.unflatten(-1, (self.value_heads, self.value_dim))
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        return q, k, v, g, b.float().sigmoid()

    def output(self, out: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """The recurrence's output [tokens, heads, value_dim] gated by z, then out_proj."""
        return self.out_proj(self.norm(out, z).flatten(-2))

    def prefill(self, x: torch.Tensor, num_seqs: int):
        """`num_seqs` equal-length sequences from zero states, x [tokens, hidden] -> (out
        [tokens, hidden], conv state [seqs, conv_dim, taps - 1] in x's dtype, recurrent state
        [seqs, heads, value_dim, key_dim] float32)."""
        mixed, z, b, a = self.project(x)
        per_seq = (num_seqs, -1)
        convolved, conv_state = causal_conv(mixed.view(*per_seq, self.conv_dim),
                                            self.conv1d[:, 0])
        q, k, v, g, beta = self.heads(convolved, b.view(*per_seq, self.value_heads),
                                      a.view(*per_seq, self.value_heads))
        out, state = opaque_chunked_delta_rule(q, k, v, g, beta, 64)
        return self.output(out.flatten(0, 1), z), conv_state, state

    def step(self, x: torch.Tensor, conv_state: torch.Tensor, state: torch.Tensor):
        """One token per sequence, x [seqs, hidden], from each sequence's `conv_state` [seqs,
        conv_dim, taps - 1] and recurrent `state` [seqs, heads, value_dim, key_dim], both
        moved on by the token in place -> [seqs, hidden]."""
        mixed, z, b, a = self.project(x)
        q, k, v, g, beta = self.heads(conv_step(mixed, conv_state, self.conv1d[:, 0]), b, a)
        out = delta_rule(*(t[:, None] for t in (q, k, v, g, beta)), state)
        return self.output(out[:, 0], z)
