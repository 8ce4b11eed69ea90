"""DeepSeek-V2's and V3's mixture of experts (chapters 01, 04, 05): the router picks k of E
experts by a softmax (V2), greedily or from the best groups of experts only, or (V3) by
sigmoid scores plus a learned per-expert bias, used for choosing only, from the best groups
(`kit.config.deepseek`); it scales their weights by routed_scaling_factor. n_shared_experts
shared experts, held as one gated MLP n_shared × moe_intermediate_size wide
(`shared_experts`, as transformers and vLLM hold them), run on every token beside the routed
ones. The first first_k_dense_replace layers have a dense MLP instead (`ModelConfig.mlp_kinds`).
"""
from __future__ import annotations

import torch
from torch import nn

from kit.config import ModelConfig
from kit.engine.layers.experts import SparseMoE
from kit.engine.layers.mlp import MLP


def group_limited(scores: torch.Tensor, n_group: int, topk_group: int,
                  top2: bool = False) -> torch.Tensor:
    """`scores` [tokens, E] with every expert outside each token's topk_group best groups set
    to -inf, a group scored by its largest score, or (`top2`, V3's biased scores) by the sum
    of its 2 largest (transformers' `DeepseekV2TopkRouter` and `DeepseekV3TopkRouter`, vLLM's
    `grouped_topk` and its CPU router's `_grouped_topk`, fused_moe/router/cpu_router.py)."""
    tokens, experts = scores.shape
    groups = scores.view(tokens, n_group, -1)
    rank = groups.topk(2, dim=-1).values.sum(-1) if top2 else groups.amax(-1)
    best = rank.topk(topk_group, dim=-1).indices
    keep = torch.zeros(tokens, n_group, dtype=torch.bool, device=scores.device)
    keep.scatter_(1, best, True)
    return groups.masked_fill(~keep[..., None], float("-inf")).view(tokens, experts)


class DeepSeekMoE(SparseMoE):
    """The router (`gate` [E, H], and V3's `e_score_correction_bias` [E], float32 whatever the
    model's dtype: `kit.engine.model.keep_float32`), the routed experts and the shared ones
    (`shared_experts`). A `SparseMoE`, so its picks are noted and replayed as every family's are."""

    def __init__(self, arch: ModelConfig, layer_idx: int = 0):
        super().__init__(arch, layer_idx)
        routing = arch.deepseek
        self.grouped, self.sigmoid = routing.grouped, routing.scoring_func == "sigmoid"
        self.n_group, self.topk_group = routing.n_group, routing.topk_group
        self.routed_scaling_factor = routing.routed_scaling_factor
        self.e_score_correction_bias = nn.Parameter(torch.zeros(arch.num_experts)) \
            if arch.router_score_bias else None
        self.shared_experts = MLP(arch, intermediate_size=arch.shared_expert_intermediate_size) \
            if arch.shared_expert_intermediate_size else None

    def picks(self, logits: torch.Tensor, ids: torch.Tensor | None = None):
        """The k best scores (float32: a softmax, or V3's sigmoid) among the eligible experts,
        chosen by the scores plus the bias where there is one, or, given `ids`, those
        experts'; weighted by their scores (never the bias), renormalised where
        norm_topk_prob, then times routed_scaling_factor."""
        logits = logits.float()
        scores = logits.sigmoid() if self.sigmoid else logits.softmax(-1)
        if ids is None:
            bias = self.e_score_correction_bias
            choice = scores if bias is None else scores + bias.float()
            if self.grouped:
                choice = group_limited(choice, self.n_group, self.topk_group, bias is not None)
            ids = choice.topk(self.top_k, dim=-1).indices
        weights = scores.gather(-1, ids)
        if self.renormalize:
            weights = weights / weights.sum(-1, keepdim=True)
        return weights * self.routed_scaling_factor, ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        routed = self.experts(x, *self.route(x))
        return routed if self.shared_experts is None else routed + self.shared_experts(x)
