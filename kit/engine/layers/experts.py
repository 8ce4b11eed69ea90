"""A mixture of experts in place of the dense MLP (chapters 01, 03–05): a router picks k of E
experts for each token, each picked expert runs the gated MLP on it, and their outputs are
summed weighted by the router's probabilities.

    router     logits = x · gate.weightᵀ (+ gate.bias, gpt-oss)   [tokens, E]
    route      softmax over the E logits (float32), the k largest, renormalised to sum to 1
               where the config says so (`ModelConfig.norm_topk_prob`; Mixtral always);
               gpt-oss ("topk_softmax"): the k largest logits, then the softmax over those k;
               Llama 4 ("topk_sigmoid"): the k largest logits' sigmoids, each scaling the
               token's input to its expert (not the output), plus a shared expert
    experts    expert e: down_e(act(gate_e · x) × up_e · x), its gate and up in one matrix
               (`gate_up_proj` [E, 2I, H], `down_proj` [E, H, I], as vLLM's FusedMoE holds them);
               gpt-oss adds each expert's biases (`gate_up_proj_bias` [E, 2I], `down_proj_bias`
               [E, H]) and clamps its SwiGLU: gate·σ(α·gate)·(up + 1), gate ≤ limit, |up| ≤ limit

Every expert's weights stay resident, but a token reads only its k. The tokens are sorted by
the expert they picked and each expert multiplies its rows in one grouped product
(`torch._grouped_mm`): an expert no token picked is never read, so a decode step moves the
bytes of the distinct experts its batch picked (`distinct_experts`). Every shape depends only
on the number of tokens, so compiled code needs no graph per routing. Where a device or dtype
has no grouped product, a product per picked expert does the same arithmetic (`grouped_mm`).

A decode step, where a step's (token, expert) pairs are no more than the experts (each expert
about one row), runs each product as one kernel over every picked expert on the CPU
(`kit.engine.layers.expert_kernel`, as vLLM's fused MoE), and as one generated loop in compiled
code elsewhere (`gathered_products`): the CPU's grouped product is a matrix product per expert,
each its own parallel region, which on a 2-core machine cost 5-8x more than the bytes it reads
(docs/experts.md, "Experts against vLLM's fused MoE").
"""
from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar

import torch
import torch.nn.functional as F
from torch import nn

from kit.config import ModelConfig
from kit.engine.layers.expert_kernel import KERNEL_DTYPES, expert_products, library
from kit.engine.layers.linear import Linear
from kit.engine.layers.mlp import MLP


def route(logits: torch.Tensor, k: int, renormalize: bool,
          ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """("softmax_topk") -> each token's k experts' weights (float32) and ids [tokens, k];
    given `ids`, the weights of those experts instead (a routing replayed)."""
    probs = logits.float().softmax(-1)
    weights, ids = probs.topk(k, dim=-1) if ids is None else (probs.gather(-1, ids), ids)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights, ids


def route_topk_softmax(logits: torch.Tensor, k: int, renormalize: bool = True,
                       ids: torch.Tensor | None = None):
    """("topk_softmax", gpt-oss) -> the softmax (float32) of each token's k largest logits, and
    their ids [tokens, k]; their weights sum to 1 by construction. Given `ids`, those
    experts' logits instead."""
    top, ids = logits.topk(k, dim=-1) if ids is None else (logits.gather(-1, ids), ids)
    return top.float().softmax(-1), ids


def route_topk_sigmoid(logits: torch.Tensor, k: int, renormalize: bool = False,
                       ids: torch.Tensor | None = None):
    """("topk_sigmoid", Llama 4) -> the sigmoid (float32) of each token's k largest logits, not
    normalised, and their ids [tokens, k] (transformers' `Llama4Router`, vLLM's
    `Llama4MoE.custom_routing_function`). Given `ids`, those experts' logits instead."""
    top, ids = logits.topk(k, dim=-1) if ids is None else (logits.gather(-1, ids), ids)
    return top.float().sigmoid(), ids


ROUTE = {"softmax_topk": route, "topk_softmax": route_topk_softmax,  # `Parts.experts` -> router
         "topk_sigmoid": route_topk_sigmoid}

_GROUPED_WORKS: dict = {}  # (device type, dtype) -> whether torch._grouped_mm runs there


def grouped_products_work(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `torch._grouped_mm` multiplies `dtype` on `device` (tried once on a tiny case)."""
    key = (device.type, dtype)
    if key not in _GROUPED_WORKS:
        try:
            x = torch.ones(2, 16, device=device, dtype=dtype)
            w = torch.ones(2, 16, 16, device=device, dtype=dtype)
            offs = torch.tensor([1, 2], device=device, dtype=torch.int32)
            _GROUPED_WORKS[key] = bool(torch._grouped_mm(x, w, offs=offs).eq(16).all())
        except (RuntimeError, AttributeError, NotImplementedError):
            _GROUPED_WORKS[key] = False
    return _GROUPED_WORKS[key]


@torch.library.custom_op("kit::grouped_mm", mutates_args=())
def grouped_mm(rows: torch.Tensor, weights: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """rows [M, K] sorted by group, weights [G, K, N], `ends` [G] each group's last row + 1
    (int32) -> [M, N], group g's rows times weights[g]; a group without rows never reads its
    weights. `torch._grouped_mm` where it runs, else a product per group with rows. One opaque
    op to the compiler (Inductor calls it as it is), since PyTorch's own shape rule for
    `_grouped_mm` admits only bfloat16."""
    if grouped_products_work(rows.device, rows.dtype):
        try:
            return torch._grouped_mm(rows, weights, offs=ends)
        except RuntimeError:  # its strides must be multiples of 16 bytes: odd sizes loop
            pass
    if rows.is_cuda and torch.cuda.is_current_stream_capturing():
        return masked_products(rows, weights, ends)
    out, start = rows.new_empty(rows.shape[0], weights.shape[2]), 0
    for g, end in enumerate(ends.tolist()):
        if end > start:
            out[start:end] = rows[start:end] @ weights[g]
        start = end
    return out


def masked_products(rows: torch.Tensor, weights: torch.Tensor, ends: torch.Tensor):
    """`grouped_mm` without reading `ends` on the host, for a CUDA graph's capture (where the
    host cannot wait for the device): every group's product over every row, each row kept
    from its own group's. Reads every expert, so it costs what a dense layer of E experts
    does; only a capture without the grouped product takes it."""
    group = torch.searchsorted(ends, torch.arange(rows.shape[0], device=rows.device,
                                                  dtype=ends.dtype), right=True)
    out = rows.new_zeros(rows.shape[0], weights.shape[2])
    for g in range(weights.shape[0]):
        out = torch.where((group == g)[:, None], rows @ weights[g], out)
    return out


@grouped_mm.register_fake
def _(rows, weights, ends):
    return rows.new_empty(rows.shape[0], weights.shape[2])


# while `noting_picks`: (layer, ids) of every routing, in order; else None
_NOTED: ContextVar[list | None] = ContextVar("noted_picks", default=None)


@torch.library.custom_op("kit::noted", mutates_args=())
def noted(ids: torch.Tensor, layer: int) -> torch.Tensor:
    """`ids` (a copy), kept with `layer` while `noting_picks` is on. One opaque op, so compiled
    code calls it too (the CPU's compiled prefill): how the routing check learns what a run's
    own compiled code picked (`kit.engine.routing_replay`)."""
    picks = _NOTED.get()
    if picks is not None:
        picks.append((layer, ids.to("cpu", copy=True)))  # compiled code reuses its buffer
    return ids.clone()


@noted.register_fake
def _(ids, layer):
    return torch.empty_like(ids)


@contextmanager
def noting_picks():
    """`with noting_picks() as noted:` every MoE layer's picks while inside, as (its layer's
    index in the model, ids [tokens, k]) in the order they ran."""
    picks = []
    token = _NOTED.set(picks)
    try:
        yield picks
    finally:
        _NOTED.reset(token)


def picks_per_expert(flat_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """How many (token, pick) pairs chose each expert, [E]: a fixed shape, so compiled code
    keeps one graph (`torch.bincount`'s shape depends on the ids, and Dynamo breaks there)."""
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat_ids.device)
    return counts.index_add_(0, flat_ids, torch.ones_like(flat_ids))


def gathered_products(rows: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                      block: int = 32) -> torch.Tensor:
    """rows [P, K] sorted by expert, `experts` [P] each row's expert, weights [E, N, K] ->
    [P, N] row p times weights[experts[p]]ᵀ, accumulated in float32, in x's dtype. Written as
    indexing and a sum for Inductor to fuse into one loop (eager it would copy every pair's
    weights): by blocks of `block` output rows, then pair, so the pairs of one expert, next to
    each other, read each block from memory once and again from cache."""
    e, n, k = weights.shape
    block = next(b for b in (block, 16, 8, 4, 2, 1) if n % b == 0)
    picked = weights.view(e, n // block, block, k)[experts]        # [P, blocks, block, K]
    out = (rows[:, None, None, :].float() * picked.float()).permute(1, 0, 2, 3).sum(-1)
    return out.permute(1, 0, 2).reshape(rows.shape[0], n).to(rows.dtype)


class Experts(nn.Module):
    """E gated MLPs, their weights stacked: `gate_up_proj` [E, 2I, H], `down_proj` [E, H, I]."""

    def __init__(self, arch: ModelConfig):
        super().__init__()
        e, h, i = arch.num_experts, arch.hidden_size, arch.moe_intermediate_size
        self.num_experts = e
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))
        self.gelu = arch.hidden_act != "silu"
        self.approximate = "none" if arch.hidden_act == "gelu" else "tanh"
        bias = arch.parts.expert_bias  # gpt-oss: each expert's biases, stacked
        self.gate_up_proj_bias = nn.Parameter(torch.empty(e, 2 * i)) if bias else None
        self.down_proj_bias = nn.Parameter(torch.empty(e, h)) if bias else None
        self.clamped = arch.parts.expert_act == "clamped_swiglu"
        self.alpha, self.limit = arch.swiglu_alpha, arch.swiglu_limit
        self.scale_input = arch.parts.experts_scale_input  # Llama 4: weight × x, not × expert(x)
        self.kernel_built = library() is not None  # `expert_products` runs here
        self.matmul_dtype = None  # float32: 16-bit weights multiplied in float32 (`multiply_in`)

    def act(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        if self.clamped:  # gpt-oss's SwiGLU, clamped
            gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
            return gate * torch.sigmoid(gate * self.alpha) * (up + 1)
        gate = F.gelu(gate, approximate=self.approximate) if self.gelu else F.silu(gate)
        return gate * up

    def one_kernel(self, pairs: int) -> bool:
        """Whether `pairs` (token, expert) pairs run as `expert_products`, on the CPU, float32
        or bf16, where the kernel built: a decode step's (no more pairs than experts), and any
        number where compiled code multiplies 16-bit weights in float32 (a CPU without native
        bf16, `Decoder.multiply_in`). There the kernel is that float32 product without a
        float32 copy of every expert (it widens each weight as it reads it): a gpt-oss-20b-like
        layer's 1,024-token prefill in bf16 took 3.0 s in it against 10.0 s grouped, emulated
        (AVX2, docs/experts.md "Experts against vLLM's fused MoE")."""
        w = self.gate_up_proj
        # (the dtype first: a compiled prefill's `pairs` is a symbol, and comparing it would
        # add a guard for nothing)
        return self.kernel_built and w.device.type == "cpu" and w.dtype in KERNEL_DTYPES and \
            (self.matmul_dtype == torch.float32 and torch.compiler.is_compiling()
             or pairs <= self.num_experts)

    def biased(self, rows: torch.Tensor, bias, expert_of_row: torch.Tensor) -> torch.Tensor:
        """Rows sorted by expert plus each row's expert's bias (none: as they are)."""
        return rows if bias is None else rows + bias[expert_of_row]

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [tokens, H], each token's k experts `ids` and their `weights` [tokens, k] ->
        Σ over its k experts of weight × expert(x) (Llama 4: of expert(weight × x), the
        weight in x's dtype as transformers rounds it), [tokens, H] in x's dtype."""
        tokens, k = ids.shape
        flat = ids.reshape(-1)
        order = flat.argsort(stable=True)  # (token, pick) pairs sorted by expert
        token_of = order // k
        picked = flat[order]
        if self.one_kernel(flat.shape[0]):
            products = expert_products  # a decode step's few pairs on the CPU: one kernel each
        elif torch.compiler.is_compiling() and flat.shape[0] <= self.num_experts:
            products = gathered_products  # elsewhere, compiled: one generated loop each
        else:
            ends = picks_per_expert(flat, self.num_experts).cumsum(0).to(torch.int32)

            def products(rows, stacked, _):  # one grouped product over every expert's rows
                return grouped_mm(rows, stacked.transpose(1, 2), ends)
        rows, weight = x[token_of], weights.reshape(-1)[order, None]
        if self.scale_input:
            rows, weight = rows * weight.to(x.dtype), 1.0
        # (no name kept for the gate-and-up rows: eager code then frees them once activated)
        hidden = self.act(self.biased(products(rows, self.gate_up_proj, picked),
                                      self.gate_up_proj_bias, picked))
        out = self.biased(products(hidden, self.down_proj, picked), self.down_proj_bias, picked)
        summed = torch.zeros(tokens, x.shape[1], dtype=torch.float32, device=x.device)
        summed.index_add_(0, token_of, out.float() * weight)
        return summed.to(x.dtype)


class SparseMoE(nn.Module):
    """The MLP of an MoE layer: the router (`gate`, a matrix [E, H], biased for gpt-oss), the
    experts, and (Llama 4) a shared expert every token runs, added to the routed ones' sum."""

    def __init__(self, arch: ModelConfig, layer_idx: int = 0):
        super().__init__()
        self.top_k, self.renormalize = arch.num_experts_per_tok, arch.norm_topk_prob
        self.router = ROUTE[arch.parts.experts]
        self.gate = Linear(arch.hidden_size, arch.num_experts, bias=arch.parts.expert_bias)
        self.experts = Experts(arch)
        self.shared_expert = MLP(arch, intermediate_size=arch.shared_expert_intermediate_size) \
            if arch.parts.shared_expert else None
        self.layer_idx = layer_idx  # the model's layer it is the MLP of (`noting_picks`)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's k experts: (weights float32, ids), [tokens, k] each (the ids noted
        while `noting_picks`)."""
        weights, ids = self.picks(self.router_logits(x))
        return weights, noted(ids, self.layer_idx)

    def router_logits(self, x: torch.Tensor) -> torch.Tensor:
        """The router's logits [tokens, E] for the hidden states `x`."""
        return self.gate(x)

    def picks(self, logits: torch.Tensor, ids: torch.Tensor | None = None):
        """The router's logits [tokens, E] -> (weights float32, ids) [tokens, k]: its top k,
        or, given `ids`, those experts' weights (`kit.engine.routing_replay`)."""
        return self.router(logits, self.top_k, self.renormalize, ids)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        routed = self.experts(x, *self.route(x))
        return routed if self.shared_expert is None else self.shared_expert(x) + routed


def one_moe_layer(arch: ModelConfig, dtype: str, seed: int = 0):
    """One MoE layer of `arch`, random weights (as `build_model` draws them)."""
    torch.manual_seed(seed)
    moe = SparseMoE(arch)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.02)
    return moe.to(getattr(torch, dtype))


def distinct_experts(ids: torch.Tensor) -> int:
    """Experts a batch's picks `ids` [tokens, k] touch: those a step must read."""
    return int(ids.unique().numel())


def expected_distinct_experts(num_experts: int, k: int, tokens: int) -> float:
    """Experts `tokens` tokens touch when each picks k of E uniformly: E·(1 − (1 − k/E)^B)."""
    return num_experts * (1 - (1 - k / num_experts) ** tokens)
