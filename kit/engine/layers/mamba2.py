"""The Mamba-2 mixer (chapters 01, 04, 05): the recurrent layer of Granite-4.0-H and Nemotron-H
hybrids, in place of attention, with a fixed state per sequence (`kit.engine.layers.state_slots`).

As transformers' `torch_forward` path (modeling_granitemoehybrid.py, modeling_nemotron_h.py)
and vLLM's `MambaMixer2` (vllm/model_executor/layers/mamba/mamba_mixer2.py) compute it:

    in_proj     x [tokens, hidden] -> z [inner], xBC [inner + 2·groups·d_state], dt [heads]
    conv        xBC through a causal depthwise convolution of width K (+ bias), then SiLU;
                its state: the last K - 1 inputs
    split       x [heads, head_dim], B and C [groups, d_state] (head h reads group
                h // (heads / groups))
    dt          softplus(dt + dt_bias); A = -exp(A_log) per head
    scan        h_t = exp(dt_t·A) · h_{t-1} + dt_t · x_t ⊗ B_t      (state [heads, head_dim,
                y_t = h_t · C_t + D · x_t                             d_state], float32)
    gated norm  RMSNorm(y · silu(z)) over groups of inner / n_norm_groups elements, times the
                norm's weight (vLLM's `Mixer2RMSNormGated`, Nemotron-H's `NemotronHRMSNormGated`;
                transformers' Granite normalises the whole width whatever mamba_n_groups: the
                two differ where it is above 1, and the kit follows vLLM)
    out_proj    [inner] -> [hidden]

A prefill runs the scan in its chunked form (the state-space dual, as transformers'
`mamba2_chunk_scan` and vLLM's `mamba_chunk_scan_combined`): within a chunk of `chunk_size`
positions, y = (C·Bᵀ ∘ decay) · (dt·x), the decay exp of segment sums of dt·A; across chunks,
the state carried chunk to chunk. Exact (float32) and free of Python loops over positions. A
compiled prefill calls the scan as one opaque operator (`opaque_chunked_scan`), as vLLM's graph
calls its mixer's: one graph serves any prompt length and compiles in a quarter of the time.
It starts from a zero state and writes its final conv and SSM states to each sequence's slot.
A decode step is one step of the recurrence, reading and overwriting the slot in place.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kit.config import ModelConfig
from kit.engine.layers.linear import Linear
from kit.engine.layers.norm import RMSNorm
from kit.engine.layers.state_slots import state_slots, write_state


class GatedRMSNorm(RMSNorm):
    """RMSNorm of y · silu(z) (float32) over groups of `group_size` elements, times the weight."""

    def __init__(self, dim: int, eps: float, group_size: int):
        super().__init__(dim, eps)
        self.group_size = group_size

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        x = y.float() * F.silu(z.float())
        g = x.view(*x.shape[:-1], -1, self.group_size)
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)
        return (g.view(x.shape) * self.weight.float()).to(y.dtype)


def segment_sum(a: torch.Tensor) -> torch.Tensor:
    """a [..., L] -> [..., L, L]: entry (i, j) = a[j+1] + ... + a[i] for j <= i, -inf above
    the diagonal; summed along the masked rows rather than as a difference of cumulative
    sums, so exp of it is exact for long chunks (transformers' `segment_sum`)."""
    length = a.shape[-1]
    below = torch.tril(torch.ones(length, length, dtype=torch.bool, device=a.device), -1)
    sums = a[..., None].expand(*a.shape, length).masked_fill(~below, 0).cumsum(-2)
    keep = torch.tril(torch.ones(length, length, dtype=torch.bool, device=a.device))
    return sums.masked_fill(~keep, float("-inf"))


def chunked_scan(x, dt, a, b, c, chunk: int):
    """The scan over whole sequences from a zero state, by chunks. x [seqs, T, heads, p],
    dt [seqs, T, heads] (already softplus'd), a [heads], b and c [seqs, T, heads, n]; all
    float32 -> (y [seqs, T, heads, p] without the D skip, final state [seqs, heads, p, n])."""
    seqs, length, heads, p = x.shape
    n = (length + chunk - 1) // chunk  # chunks: padded to n·chunk, never `-length % chunk`

    def chunks(t):  # [seqs, T, ...] -> [seqs, n, chunk, ...], zero-padded
        t = F.pad(t, (0, 0) * (t.dim() - 2) + (0, n * chunk - length))
        return t.reshape(seqs, n, chunk, *t.shape[2:])
    x, b, c = chunks(x * dt[..., None]), chunks(b), chunks(c)
    da = chunks(dt * a).permute(0, 3, 1, 2)                 # [seqs, heads, chunks, chunk]
    cum = da.cumsum(-1)
    decay = torch.exp(segment_sum(da))                      # [seqs, heads, chunks, l, s]
    scores = torch.einsum("bclhn,bcshn->bhcls", c, b) * decay
    y = torch.einsum("bhcls,bcshp->bclhp", scores, x)       # within each chunk
    to_end = torch.exp(cum[..., -1:] - cum)                 # [seqs, heads, chunks, chunk]
    states = torch.einsum("bclhn,bhcl,bclhp->bchpn", b, to_end, x)  # each chunk's own
    states = torch.cat([torch.zeros_like(states[:, :1]), states], 1)
    across = torch.exp(segment_sum(F.pad(cum[..., -1], (1, 0))))  # [seqs, heads, c+1, c+1]
    states = torch.einsum("bhzc,bchpn->bzhpn", across, states)
    y = y + torch.einsum("bclhn,bchpn,bhcl->bclhp", c, states[:, :-1], torch.exp(cum))
    return y.reshape(seqs, n * chunk, heads, p)[:, :length], states[:, -1]


@torch.library.custom_op("kit::mamba2_chunked_scan", mutates_args=())
def opaque_chunked_scan(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                        c: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`chunked_scan` as one operator, which a compiled prefill calls without tracing into it
    (as vLLM's `vllm::mamba_mixer2`, one of the splitting ops of its CompilationConfig, keeps
    the conv and the scan out of the graph Inductor compiles). Inductor's code for the scan at
    a symbolic prompt length took most of tiny-mamba's prefill compile; docs/hybrids.md
    ("Compiling a prefill through the scan") gives the times. Eager, it is `chunked_scan`
    itself."""
    y, final = chunked_scan(x, dt, a, b, c, chunk)
    return y.contiguous(), final.contiguous()


@opaque_chunked_scan.register_fake
def _(x, dt, a, b, c, chunk):
    seqs, length, heads, p = x.shape
    return x.new_empty(seqs, length, heads, p), x.new_empty(seqs, heads, p, b.shape[-1])


class Mamba2Mixer(nn.Module):
    """One Mamba-2 layer: its weights under transformers' names (`in_proj`, `conv1d`,
    `dt_bias`, `A_log`, `D`, `norm`, `out_proj`), its state's slot bound from the run's layout
    (`bind_kv_cache`, as attention's cache is)."""

    def __init__(self, arch: ModelConfig, layer_idx: int = 0):
        super().__init__()
        rec = arch.recurrent
        self.layer_idx, self.heads, self.head_dim = layer_idx, rec.heads, rec.head_dim
        self.groups, self.d_state, self.inner = rec.groups, rec.state_dim, rec.inner
        self.kernel, self.chunk = rec.conv_kernel, rec.chunk_size
        self.conv_dim = rec.inner + 2 * rec.groups * rec.state_dim
        self.in_proj = Linear(arch.hidden_size, rec.inner + self.conv_dim + rec.heads,
                              bias=rec.proj_bias)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, rec.conv_kernel,
                                groups=self.conv_dim, bias=rec.conv_bias)
        self.dt_bias = nn.Parameter(torch.empty(rec.heads))
        self.A_log = nn.Parameter(torch.empty(rec.heads))
        self.D = nn.Parameter(torch.empty(rec.heads))
        self.norm = GatedRMSNorm(rec.inner, arch.rms_norm_eps, rec.inner // rec.norm_groups)
        self.out_proj = Linear(rec.inner, arch.hidden_size, bias=rec.proj_bias)
        self.state_group = self.place = self.block_size = None  # `bind_kv_cache`

    def bind_kv_cache(self, layout) -> None:
        """This layer's recurrent group (whose block holds a sequence's state), its place
        (which row of the states' tensors), and the block size: plain numbers."""
        self.state_group, self.place = layout.place(self.layer_idx)
        self.block_size = layout.block_size

    def forward(self, x, cos, sin, num_seqs: int, meta=None, handed_on=None):
        """x [tokens, hidden] (num_seqs sequences of equal length, or one token each in a
        decode step, `meta.block_tables` given) -> [tokens, hidden]; RoPE's cos and sin unused."""
        z, xbc, dt = self.in_proj(x).split([self.inner, self.conv_dim, self.heads], dim=-1)
        slots = None
        if meta is not None and meta.states is not None:
            if self.state_group is None:
                raise RuntimeError("the model's layers have no state slots: call "
                                   "model.bind_kv_cache(layout) before a paged forward")
            slots = state_slots(meta, self.state_group, self.block_size, num_seqs)
            if meta.block_tables is not None:
                return self.out_proj(self.norm(self.decode(xbc, dt, meta.states, slots), z))
        y = self.prefill(xbc.view(num_seqs, -1, self.conv_dim), dt.view(num_seqs, -1, self.heads),
                         None if slots is None else meta.states, slots)
        return self.out_proj(self.norm(y.reshape(z.shape), z))

    def split_xbc(self, xbc: torch.Tensor):
        """Convolved xBC [..., conv_dim] -> x [..., heads, p], B and C [..., heads, n] (each
        head its group's)."""
        x, b, c = xbc.float().split([self.inner, self.groups * self.d_state,
                                     self.groups * self.d_state], dim=-1)
        per_group = self.heads // self.groups

        def by_head(t):
            t = t.reshape(*t.shape[:-1], self.groups, self.d_state)
            return t.repeat_interleave(per_group, dim=-2)
        return x.reshape(*x.shape[:-1], self.heads, self.head_dim), by_head(b), by_head(c)

    def time_steps(self, dt: torch.Tensor) -> torch.Tensor:
        return F.softplus(dt.float() + self.dt_bias.float())

    def prefill(self, xbc, dt, states, slots):
        """Whole sequences [seqs, T, ...] from zero states; the final states to `slots`."""
        seqs, length, _ = xbc.shape
        w = self.conv1d.weight
        conv = F.conv1d(xbc.transpose(1, 2).to(w.dtype), w, self.conv1d.bias,
                        padding=self.kernel - 1, groups=self.conv_dim)[..., :length]
        x, b, c = self.split_xbc(F.silu(conv).transpose(1, 2))
        dt = self.time_steps(dt)
        y, final = opaque_chunked_scan(x, dt, -torch.exp(self.A_log.float()), b, c, self.chunk)
        y = y + x * self.D.float()[:, None]
        if slots is not None:  # the last K - 1 inputs (zeros before the prompt) and the state
            tail = F.pad(xbc.transpose(1, 2), (self.kernel - 1, 0))[..., -(self.kernel - 1):]
            write_state(states.conv, self.place, slots, tail)
            write_state(states.ssm, self.place, slots, final)
        return y.to(xbc.dtype)

    def decode(self, xbc, dt, states, slots):
        """One token per sequence [seqs, ...]: one step of the convolution and the scan from
        each sequence's slot, which it overwrites."""
        conv_state, ssm_state = states.conv[self.place], states.ssm[self.place]
        window = torch.cat([conv_state[slots].to(xbc.dtype), xbc[..., None]], -1)
        write_state(states.conv, self.place, slots, window[..., 1:])
        w = self.conv1d.weight[:, 0]
        conv = (window.float() * w.float()).sum(-1)
        if self.conv1d.bias is not None:
            conv = conv + self.conv1d.bias.float()
        x, b, c = self.split_xbc(F.silu(conv))
        dt = self.time_steps(dt)                                   # [seqs, heads]
        decay = torch.exp(dt * -torch.exp(self.A_log.float()))     # [seqs, heads]
        h = ssm_state[slots].float() * decay[..., None, None] + \
            (dt[..., None] * x)[..., None] * b[:, :, None, :]
        write_state(states.ssm, self.place, slots, h)
        y = (h * c[:, :, None, :]).sum(-1) + x * self.D.float()[:, None]
        return y.reshape(xbc.shape[0], self.inner).to(xbc.dtype)
