"""A run's logits against a run without any cache (chapters 04 and 05, and the tests): each
sequence's prompt and the tokens the run fed back, in one causal forward over the whole
sequence (`no_cache_logits`); every step's logits must equal those within a tolerance by dtype
(`check_against_no_cache`, `Correctness`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kit.config import TOLERANCE
from kit.engine.model import Decoder
from kit.units import Fraction, Number

if TYPE_CHECKING:
    from kit.engine.decode import Generation


@torch.no_grad()
def no_cache_logits(model: Decoder, prompt: torch.Tensor, fed: torch.Tensor) -> torch.Tensor:
    """The logits a run must have produced for one sequence, recomputed without any cache: its
    prompt and the tokens fed back (`fed`, one per decode step) in one causal forward over the
    whole sequence; by causality position n - 1 + t holds step t's logits (step 0: the
    prefill). -> [len(fed) + 1, vocab], float32 on the CPU."""
    device = next(model.parameters()).device
    ids = torch.cat([prompt, fed]).to(device)[None]
    hidden = model(ids)[0, len(prompt) - 1:]
    return model.compute_logits(hidden).float().cpu()


@dataclass
class Correctness:
    """How far a paged run's logits are from the no-cache reference, step by step: the largest
    |paged - reference| over the batch, relative to the reference logits' largest magnitude.
    An MoE's reference replays the run's routing (`kit.engine.routing_replay`): `routing`
    then says where the reference's own router would have picked otherwise, and how close
    those picks were."""

    dtype: str
    tolerance: float
    errors: list[float]            # step 0 is the prefill, then each decode step
    token_agreement: float         # fraction of steps where both pick the same greedy token
    routing: "object | None" = None  # a `kit.engine.routing_replay.Flips` where replayed
    ties: float = 0.0  # fraction of steps whose tokens differ where the reference's best ties

    @property
    def agreement_up_to_ties(self) -> float:
        """The run's greedy token is one the reference could pick as its own, at this share of
        the steps (a random model's logits tie in 16 bits, and which of the tied tokens argmax
        returns depends on each CPU's order of summing)."""
        return self.token_agreement + self.ties

    @property
    def max_error(self) -> float:
        return max(self.errors)

    @property
    def ok(self) -> bool:
        return self.max_error <= self.tolerance and (self.routing is None or self.routing.ok)

    def summary(self) -> dict:
        routing = {} if self.routing is None else {"routing": self.routing.summary()}
        return {"dtype": self.dtype, **Number.of({"tolerance": self.tolerance,
                                                  "max_error": self.max_error}),
                "ok": self.ok, "token_agreement": Fraction(self.token_agreement),
                "errors": Number.of(self.errors), **routing}


def check_against_no_cache(model: Decoder, prompts, run: Generation, dtype: str,
                           reference=None, routing=None) -> Correctness:
    """Compare every step's logits of `run` with the no-cache reference, one sequence at a time
    (so only one sequence's reference logits are held at once). `reference(i, prompt, fed)`:
    sequence i's reference logits (default `no_cache_logits`); `routing`: what it replayed."""
    steps = len(run.step_seconds)
    diff = scale = torch.zeros(steps + 1)
    same = tied = 0
    for i, prompt in enumerate(prompts):
        fed = run.tokens[i, :steps]
        ref = no_cache_logits(model, prompt, fed) if reference is None else \
            reference(i, prompt, fed)
        got = run.logits[:, i].float()
        diff = torch.maximum(diff, (got - ref).abs().amax(-1))
        scale = torch.maximum(scale, ref.abs().amax(-1))
        agree = int((got.argmax(-1) == ref.argmax(-1)).sum())
        one_of_best = ref.gather(-1, got.argmax(-1, keepdim=True)).squeeze(-1) == ref.amax(-1)
        same, tied = same + agree, tied + int(one_of_best.sum()) - agree
    total = (steps + 1) * len(prompts)
    return Correctness(dtype, TOLERANCE[dtype], (diff / scale).tolist(), same / total, routing,
                       tied / total)
