"""Which experts each decode step's tokens picked (chapter 04): what an MoE step really reads.

A decode step reads the router and only the distinct experts its batch picked, so the bytes it
must move depend on the routing, step by step. `ExpertPicks` records them: a forward hook on
every MoE layer's router (`SparseMoE.gate`) routes the router's logits as the layer does
(`SparseMoE.picks`, the same function, so the same ids) and keeps, per step and
per MoE layer, the sorted distinct expert ids. It records only inside the steps it wraps
(`ExpertPicks.wrap`), not the prefill. The hooks read ids back to the host, so they run on an
eager pass (`record_picks`); routing is the same whichever strategy runs the step, and the
model's outputs are untouched (a hook that returns nothing changes nothing).
"""
from __future__ import annotations

from contextlib import contextmanager

import torch

from kit.engine.decode import generate, step_function
from kit.engine.layers.experts import SparseMoE


class ExpertPicks:
    """Per recorded step, each MoE layer's distinct expert ids: `steps[t][j]` for the j-th MoE
    layer (layers in order; a dense layer among them has no entry)."""

    def __init__(self, model: torch.nn.Module):
        self.layers = {name: (i, m) for i, (name, m) in enumerate(moe_layers(model))}
        self.steps: list[dict[int, tuple[int, ...]]] = []
        self.recording = False
        self.handles = []

    def attach(self) -> "ExpertPicks":
        for _, (i, moe) in self.layers.items():
            self.handles.append(moe.gate.register_forward_hook(
                lambda mod, args, logits, i=i, moe=moe: self.on_router(i, moe, logits)))
        return self

    def detach(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    def on_router(self, layer: int, moe: SparseMoE, logits: torch.Tensor) -> None:
        if self.recording:
            _, ids = moe.picks(logits)
            self.steps[-1][layer] = tuple(ids.unique().tolist())

    def wrap(self, step):
        """`step` (a decode step function) recording each call as one step."""
        def recorded(*args):
            self.steps.append({})
            self.recording = True
            try:
                return step(*args)
            finally:
                self.recording = False
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


@contextmanager
def recording_picks(model: torch.nn.Module):
    """`with recording_picks(model) as picks:` hooks on every router while inside; run the
    steps through `picks.wrap(step)` to record them."""
    picks = ExpertPicks(model).attach()
    try:
        yield picks
    finally:
        picks.detach()


@torch.no_grad()
def record_picks(model, batch, prompts: list[torch.Tensor], steps: int, keep_logits=False):
    """An eager run of `batch` (prefill, then `steps` decode steps) recording each step's
    picks: (picks, the run, a `kit.engine.decode.Generation`)."""
    with recording_picks(model) as picks:
        run = generate(model, batch, prompts, steps, keep_logits=keep_logits,
                       step=picks.wrap(step_function(model, batch.max_context_len)))
    return picks, run
