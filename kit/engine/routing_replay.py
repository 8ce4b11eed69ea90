"""The correctness check of an MoE's paged run, with its routing replayed (chapters 04, 05).

A paged step and the no-cache reference compute the same hidden states in different orders, so
they differ by rounding: in float32 by about 1e-6, in bf16 by about 1e-2. A dense model's logits
stay within the tolerance. A router does not: where two experts' scores are closer than that
rounding, the run and the reference pick different experts for the token, and its output
differs by a whole expert's. Random weights in 16 bits put a few such near-ties in every run.

So the reference of a model with experts routes every token as the paged run routed it:
`record_routing` reruns the paged run, fed the run's own tokens, and keeps every MoE layer's
picks at every position (`noting_picks`: its prompt's in the prefill, then one per step, each
through the run's own runner, compiled or not, which rounds as the run did and so picks as it
did; CUDA graphs replay without running Python, so their steps are rerun eagerly); the
reference's routers then weigh those experts (`SparseMoE.picks(logits, ids)`) instead of their
own top k. What is left is rounding, checked against the dtype's tolerance as for a dense model.

Each pick the reference's router would have made otherwise is a flip, kept with its gap: the
reference's k-th minus (k+1)-th router logit there, relative to the largest in magnitude of the
token's router logits (every router ranks experts by logit; all of them may be negative, and
relative to a top logit of -0.008 tiny-gdn's gap of 0.005 read 0.63). A flip is a near-tie only
if that gap is within the tolerance; a flip across a wider gap means the run routed wrongly, and
the check fails (`Flips.ok`). Where the rerun's steps are eager (a CUDA graph's), a step rounds
otherwise than the rerun and may flip a near-tie the rerun did not: such a step is checked
against the other side of the tie (`explained_reference`), and counted.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from kit.config import TOLERANCE
from kit.engine.decode import PagedBatch, generate, prefill_order, step_for
from kit.engine.expert_picks import moe_layers
from kit.engine.layers.experts import noting_picks
from kit.engine.no_cache import Correctness, check_against_no_cache, no_cache_logits
from kit.units import Count, Number


@dataclass
class Flips:
    """Where the reference's routers would have picked other experts than the run's."""

    tolerance: float
    positions: int = 0           # (position, MoE layer) pairs routed, over every sequence
    gaps: list[float] = field(default_factory=list)  # each flip's gap, relative
    explained: list = field(default_factory=list)  # (step, MoE layer, gap) taken across a tie

    @property
    def ok(self) -> bool:
        return all(g <= self.tolerance for g in self.gaps)

    def summary(self) -> dict:
        return {**Count.of({"routed": self.positions, "flips": len(self.gaps),
                            "steps_across_a_tie": len(self.explained)}),
                "largest_flip_gap": Number(max(self.gaps, default=0.0)), "ok": self.ok}


def record_routing(model, batch: PagedBatch, prompts, run, prefill=None,
                   step=None) -> list[list[torch.Tensor]]:
    """Every MoE layer's picks at every position of each sequence of `run`, from a paged rerun
    of its batch fed the run's tokens, its prefill through `prefill` and its steps through
    `step` (the run's own runners, or eager for None: compiled code rounds otherwise than
    eager code and may cross a near-tie the eager rerun would not; a CUDA graph's replay runs
    no Python and notes nothing, so its steps are rerun eagerly):
    [sequence][MoE layer] -> ids [positions, k]."""
    steps = len(run.step_seconds)
    if step is None or getattr(step, "strategy", None) == "cuda_graphs":
        step = step_for(model, batch)
    with noting_picks() as noted:
        generate(model, batch, prompts, steps, keep_logits=False, prefill=prefill,
                 step=fed_step(step, run.tokens))
    layers = sorted({layer for layer, _ in noted})
    calls = [[ids for layer, ids in noted if layer == j] for j in layers]  # per MoE layer
    return [[torch.cat([prefill_rows(ids, batch.lengths, i), *(s[i:i + 1] for s in
                        ids[len(set(batch.lengths)):])]) for ids in calls]
            for i in range(len(prompts))]


def fed_step(step, tokens: torch.Tensor):
    """`step` fed step t's token from `tokens` [seqs, steps + 1] (the run being checked)
    rather than the rerun's own greedy pick, so the rerun sees the run's sequences."""
    count = iter(range(tokens.shape[1]))

    def fed(input_ids, *rest):
        input_ids.copy_(tokens[:, next(count)].to(input_ids.device))
        return step(input_ids, *rest)
    return fed


def prefill_rows(calls: list[torch.Tensor], lengths: list[int], seq: int) -> torch.Tensor:
    """Sequence `seq`'s rows of the prefill's forwards (`PagedBatch.prefill`: one per prompt
    length, its sequences in `prefill_order`, their tokens flattened)."""
    length = lengths[seq]
    call = sorted(set(lengths)).index(length)
    row = [i for i in prefill_order(lengths) if lengths[i] == length].index(seq)
    return calls[call][row * length:(row + 1) * length]


@contextmanager
def replaying(model, routing: list[torch.Tensor], flips: Flips, ranked: list | None = None):
    """Inside, each MoE layer of `model` routes a whole sequence's forward by `routing` (one ids
    tensor per MoE layer), recording in `flips` where its own router would not have, and in
    `ranked` (when given) each layer's top k + 1 experts and gap at every position."""
    layers = [moe for _, moe in moe_layers(model)]
    for moe, ids in zip(layers, routing):
        moe.route = lambda x, moe=moe, ids=ids: replayed(moe, x, ids, flips, ranked)
    try:
        yield
    finally:
        for moe in layers:
            del moe.route  # back to the class's own router


def replayed(moe, x: torch.Tensor, ids: torch.Tensor, flips: Flips, ranked: list | None):
    """`moe`'s routing of `x` at the recorded `ids` (a row of -1: its own), its own top k
    compared with them."""
    logits = moe.router_logits(x)
    _, own = moe.picks(logits)
    ids = ids.to(logits.device)
    ids = torch.where(ids < 0, own, ids)
    top = logits.float().topk(moe.top_k + 1, dim=-1)  # every router ranks experts by logit
    differ = (own.sort(-1).values != ids.sort(-1).values).any(-1)
    scale = logits.float().abs().amax(-1).clamp_min(1e-30)  # (all may be negative)
    gaps = (top.values[:, -2] - top.values[:, -1]) / scale
    flips.positions += x.shape[0]
    flips.gaps += gaps[differ].cpu().tolist()
    if ranked is not None:
        ranked.append((top.indices.cpu(), gaps.cpu()))
    return moe.picks(logits, ids)


def check_routed_against_no_cache(model, batch: PagedBatch, prompts, run, dtype: str,
                                  prefill=None, step=None) -> Correctness:
    """`check_against_no_cache`, its reference routed as `run` was where the model has experts
    (`record_routing`, the run's prefill through `prefill` and its steps through `step`, its
    runners; `explained_reference`), its flips in the result; a dense model's as it is."""
    if not moe_layers(model):
        return check_against_no_cache(model, prompts, run, dtype)
    routing = record_routing(model, batch, prompts, run, prefill, step)
    flips = Flips(TOLERANCE[dtype])

    def reference(i, prompt, fed):
        return explained_reference(model, prompt, fed, routing[i], run.logits[:, i], flips)
    return check_against_no_cache(model, prompts, run, dtype, reference, flips)


def explained_reference(model, prompt, fed, routing, got: torch.Tensor, flips: Flips):
    """One sequence's reference logits, routed by `routing`. The rerun that recorded it is
    eager; a compiled step rounds otherwise and may flip a near-tie the rerun did not. So the
    first step the run's logits `got` miss by more than the tolerance is tried once more across
    the near-ties at its position (`across_ties`). If a routing explains the step, it becomes
    the reference's from there on (the run's later steps read that token's keys and values as
    it routed them), `flips.explained` keeps (step, MoE layer, gap) per tie crossed, and the
    next step missed is tried; a step no near-tie explains stays off, and fails the check."""
    ref, ranked = routed_logits(model, prompt, fed, routing, flips)
    steps = off_steps(got, ref, flips.tolerance)
    while steps:
        step = steps[0]
        found = across_ties(model, prompt, fed, got, step, routing, ranked, flips.tolerance)
        if found is not None:
            ref, ranked, routing, crossed = found
            flips.explained += [(step, j, gap) for j, gap in crossed]
        steps = [s for s in off_steps(got, ref, flips.tolerance) if s > step]
    return ref


def across_ties(model, prompt, fed, got, step: int, routing, ranked, tolerance: float,
                first: int = 0, depth: int = 2):
    """A routing that explains `step` of `got`: the other side of the near-tie (gap within
    `tolerance`) of one MoE layer from `first` on at the step's position, the layers after it
    routing as they then see; failing that, of one more layer after it too (up to `depth`
    ties). -> (logits, ranked, routing, [(layer, gap), ...]) or None."""
    position = len(prompt) - 1 + step
    for j in range(first, len(ranked)):
        top, gaps = ranked[j]
        if gaps[position] > tolerance:
            continue
        picked = routing[j][position] if routing[j][position][0] >= 0 else top[position][:len(
            routing[j][position])]
        alt = across(routing, j, position, other_side(picked, top[position]))
        logits, alt_ranked = routed_logits(model, prompt, fed, alt, Flips(tolerance))
        crossed = [(j, float(gaps[position]))]
        if not off_steps(got[step:step + 1], logits[step:step + 1], tolerance):
            return logits, alt_ranked, alt, crossed
        if depth > 1:
            deeper = across_ties(model, prompt, fed, got, step, alt, alt_ranked, tolerance,
                                 j + 1, depth - 1)
            if deeper is not None:
                return *deeper[:3], crossed + deeper[3]
    return None


def routed_logits(model, prompt, fed, routing, flips: Flips):
    """The no-cache logits of one sequence routed by `routing`, and each MoE layer's top k + 1
    and gaps at every position."""
    ranked: list = []
    with replaying(model, routing, flips, ranked):
        return no_cache_logits(model, prompt, fed), ranked


def across(routing: list[torch.Tensor], layer: int, position: int, other: torch.Tensor):
    """`routing` with MoE layer `layer` taking `other` at `position`, and the layers after it
    their own top k there (-1: a flip changes what they see)."""
    alt = [ids.clone() for ids in routing]
    alt[layer][position] = other
    for ids in alt[layer + 1:]:
        ids[position] = -1
    return alt


def off_steps(got: torch.Tensor, ref: torch.Tensor, tolerance: float) -> list[int]:
    """Steps whose logits `got` [steps, vocab] are off `ref` by more than `tolerance`."""
    err = (got.float() - ref).abs().amax(-1) / ref.abs().amax(-1).clamp_min(1e-30)
    return (err > tolerance).nonzero().flatten().tolist()


def other_side(ids: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
    """The picks across a near-tie from `ids` (k experts): where they are the top k of `top`
    (the reference's top k + 1), the k - 1 best and the (k+1)-th; otherwise the top k."""
    k = ids.numel()
    if set(ids.tolist()) == set(top[:k].tolist()):
        return torch.cat([top[:k - 1], top[k:]])
    return top[:k].clone()
