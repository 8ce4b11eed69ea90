"""DeepSeek-V2's mixture of experts (chapters 01, 04, 05): the router picks k of E experts by
a softmax, greedily or from the best groups of experts only (`kit.config.deepseek`), scales
their weights by routed_scaling_factor, and n_shared_experts shared experts, held as one gated
MLP n_shared × moe_intermediate_size wide (`shared_experts`, as transformers and vLLM hold
them), run on every token beside the routed ones. The first first_k_dense_replace layers (and
those off moe_layer_freq) have a dense MLP instead (`ModelConfig.mlp_kinds`).
"""
from __future__ import annotations

import torch

from kit.config import ModelConfig
from kit.engine.layers.experts import SparseMoE
from kit.engine.layers.mlp import MLP


def group_limited(probs: torch.Tensor, n_group: int, topk_group: int) -> torch.Tensor:
    """`probs` [tokens, E] with every expert outside each token's topk_group best groups
    (a group scored by its largest probability) set to 0 (transformers'
    `DeepseekV2TopkRouter`, vLLM's `grouped_topk` with softmax scores)."""
    tokens, experts = probs.shape
    groups = probs.view(tokens, n_group, -1)
    best = groups.amax(-1).topk(topk_group, dim=-1).indices
    keep = torch.zeros(tokens, n_group, dtype=torch.bool, device=probs.device)
    keep.scatter_(1, best, True)
    return groups.masked_fill(~keep[..., None], 0.0).view(tokens, experts)


class DeepSeekMoE(SparseMoE):
    """The router (`gate` [E, H]), the routed experts and the shared ones (`shared_experts`).
    A `SparseMoE`, so its picks are noted and replayed as every family's are."""

    def __init__(self, arch: ModelConfig, layer_idx: int = 0):
        super().__init__(arch, layer_idx)
        routing = arch.deepseek
        self.grouped = routing.topk_method == "group_limited_greedy"
        self.n_group, self.topk_group = routing.n_group, routing.topk_group
        self.routed_scaling_factor = routing.routed_scaling_factor
        self.shared_experts = MLP(arch, intermediate_size=arch.shared_expert_intermediate_size) \
            if arch.shared_expert_intermediate_size else None

    def picks(self, logits: torch.Tensor, ids: torch.Tensor | None = None):
        """The softmax's k largest (float32) among the eligible experts, or, given `ids`,
        those experts' probabilities; renormalised where norm_topk_prob, then times
        routed_scaling_factor."""
        probs = logits.float().softmax(-1)
        if ids is None:
            eligible = group_limited(probs, self.n_group, self.topk_group) if self.grouped \
                else probs
            ids = eligible.topk(self.top_k, dim=-1).indices
        weights = probs.gather(-1, ids)
        if self.renormalize:
            weights = weights / weights.sum(-1, keepdim=True)
        return weights * self.routed_scaling_factor, ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        routed = self.experts(x, *self.route(x))
        return routed if self.shared_experts is None else routed + self.shared_experts(x)
