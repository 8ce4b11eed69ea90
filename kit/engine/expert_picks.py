"""Which experts each decode step's tokens picked (chapter 04): what an MoE step really reads.

A decode step reads the router and only the distinct experts its batch picked, so the bytes it
must move depend on the routing, step by step. `ExpertPicks` records them: every MoE layer
notes its picks while `noting_picks` is on (`kit.engine.layers.experts.noted`, the ids the
layer routes by), and each step wrapped (`ExpertPicks.wrap`) keeps, per MoE layer, the sorted
distinct expert ids; not the prefill. `record_picks` runs an eager pass; routing is the same
whichever strategy runs the step, and the model's outputs are untouched.
"""
from __future__ import annotations

import torch

from kit.engine.decode import generate, step_for
from kit.engine.layers.experts import SparseMoE, noting_picks


class ExpertPicks:
    """Per recorded step, each MoE layer's distinct expert ids: `steps[t][j]` for the j-th MoE
    layer (layers in order; a dense layer among them has no entry)."""

    def __init__(self, model: torch.nn.Module):
        self.order = {m.layer_idx: j for j, (_, m) in enumerate(moe_layers(model))}
        self.steps: list[dict[int, tuple[int, ...]]] = []

    def wrap(self, step):
        """`step` (a decode step function) recording each call as one step."""
        def recorded(*args):
            with noting_picks() as noted:
                out = step(*args)
            self.steps.append({self.order[layer]: tuple(ids.unique().tolist())
                               for layer, ids in noted})
            return out
        return recorded

    def counts(self) -> list[tuple[int, ...]]:
        """Per step, each MoE layer's number of distinct experts (in layer order)."""
        return [tuple(len(step[i]) for i in sorted(step)) for step in self.steps]

    def mean_distinct(self) -> float:
        """Distinct experts per MoE layer per step, averaged over every step and layer."""
        counts = [c for step in self.counts() for c in step]
        return sum(counts) / len(counts) if counts else 0.0


def moe_layers(model: torch.nn.Module) -> list[tuple[str, SparseMoE]]:
    """The model's MoE MLPs, in layer order (none for a dense model)."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, SparseMoE)]


@torch.no_grad()
def record_picks(model, batch, prompts: list[torch.Tensor], steps: int, keep_logits=False):
    """An eager run of `batch` (prefill, then `steps` decode steps) recording each step's
    picks: (picks, the run, a `kit.engine.decode.Generation`)."""
    picks = ExpertPicks(model)
    run = generate(model, batch, prompts, steps, keep_logits=keep_logits,
                   step=picks.wrap(step_for(model, batch)))
    return picks, run
