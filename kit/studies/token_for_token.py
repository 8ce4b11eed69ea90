"""Chapter 05, token for token: vLLM loads the same checkpoint folder as the kit (real weights,
no dummy load) and both generate greedily from the same prompts.

Per step and sequence: whether the greedy tokens agree, the kit's and vLLM's log-probability of
vLLM's token, and the margin between the kit's two best logits (relative to the largest
logit). Random weights give small margins, so a 16-bit run may part ways where the margin is
below the dtype's tolerance: the check is every token in float32, and in 16 bits every step of
a sequence up to its first step whose margin is under the tolerance (that step is named).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from kit.config import TOLERANCE, Settings
from kit.engine.checkpoint import write_checkpoint
from kit.engine.decode import batch_for_run, generate, make_prompts, prompt_lengths
from kit.engine.kv_cache import KVCacheLayout
from kit.engine.model import build_model
from kit.measure.timing import median_or_none
from kit.vllm.engine_runs import engine_timings
from kit.vllm.greedy import greedy_from_checkpoint
from kit.vllm.model_folder import MODELS_CACHE, cached_model_folder
from kit.units import Count, Fraction, Number, Seconds

CHECKPOINTS = MODELS_CACHE.parent / "checkpoints"
BLOCK_SIZE = 128  # vLLM's CPU attention takes multiples of 32; the kit's decode any size


def chapter_checkpoint(settings: Settings) -> Path:
    """The folder both sides load: the settings' checkpoint folder, else the chapter's random
    weights (drawn from the seed, as every chapter draws them) written once per configuration,
    dtype and seed under `CHECKPOINTS`."""
    if settings.arch.checkpoint:
        return Path(settings.arch.checkpoint)
    name = f"{cached_model_folder(settings.arch).name}-{settings.dtype}-seed{settings.seed}"
    folder = CHECKPOINTS / name
    if not (folder / "model.safetensors").is_file():
        partial = folder.with_name(f"{name}.partial-{os.getpid()}")
        write_checkpoint(build_model(settings.arch, settings.dtype, "cpu", settings.seed),
                         partial)
        os.replace(partial, folder)
    return folder


@dataclass
class TokenStep:
    """One sequence at one step (0: the prefill's token)."""

    seq: int
    step: int
    kit_token: int
    vllm_token: int
    kit_logprob: float | None   # the kit's log-probability of vLLM's token (None once parted)
    vllm_logprob: float
    margin: float               # (kit's best - second best logit) / largest |logit|

    @property
    def agree(self) -> bool:
        return self.kit_token == self.vllm_token

    def summary(self) -> dict:
        return {**Count.of({"seq": self.seq, "step": self.step, "kit_token": self.kit_token,
                            "vllm_token": self.vllm_token}),
                **Number.of({"kit_logprob": self.kit_logprob, "vllm_logprob": self.vllm_logprob,
                             "margin": self.margin}), "agree": self.agree}


@dataclass
class TokenComparison:
    dtype: str
    folder: str
    steps: list[TokenStep] = field(default_factory=list)
    error: str | None = None    # vLLM could not run the comparison (its message)
    # with `compare_tokens(..., time_steps=True)`: eager decode steps, in turns (seconds)
    kit_step_seconds: list[float] = field(default_factory=list)
    vllm_step_seconds: list[float] = field(default_factory=list)

    @property
    def tolerance(self) -> float:
        return TOLERANCE[self.dtype]

    def first_low_margin(self, seq: int) -> int | None:
        """The first step of `seq` whose margin is under the dtype's tolerance (float32: none
        counts, every token must agree)."""
        if self.dtype == "float32":
            return None
        return next((s.step for s in self.steps if s.seq == seq and s.margin < self.tolerance),
                    None)

    def expected_to_agree(self, s: TokenStep) -> bool:
        low = self.first_low_margin(s.seq)
        return low is None or s.step < low

    @property
    def ok(self) -> bool:
        return not self.error and bool(self.steps) and all(
            s.agree for s in self.steps if self.expected_to_agree(s))

    @property
    def checked(self) -> int:
        """Steps that must agree: every one in float32, those before a sequence's first low
        margin in 16 bits."""
        return sum(self.expected_to_agree(s) for s in self.steps)

    @property
    def agreement(self) -> float:
        return sum(s.agree for s in self.steps) / len(self.steps) if self.steps else 0.0

    def step_row(self) -> dict:
        """The eager decode step side by side (`time_steps`): medians and their ratio."""
        kit, vllm = median_or_none(self.kit_step_seconds), median_or_none(self.vllm_step_seconds)
        return {"decode step, eager": self.dtype,
                "kit (ms)": "n/a" if kit is None else f"{kit * 1e3:.2f}",
                "vLLM (ms)": "n/a" if vllm is None else f"{vllm * 1e3:.2f}",
                "kit ÷ vLLM": "n/a" if not (kit and vllm) else f"{kit / vllm:.2f}",
                "steps timed (kit, vLLM)": f"{len(self.kit_step_seconds)}, "
                                           f"{len(self.vllm_step_seconds)}"}

    def summary(self) -> dict:
        seqs = sorted({s.seq for s in self.steps})
        steps = {"kit_step_median": median_or_none(self.kit_step_seconds),
                 "vllm_step_median": median_or_none(self.vllm_step_seconds)}
        return {"dtype": self.dtype, "checkpoint": self.folder, "ok": self.ok,
                **Seconds.of(steps), "timed_steps": Count.of(len(self.kit_step_seconds)),
                "error": self.error,
                "agreement": Fraction(self.agreement), "tolerance": Number(self.tolerance),
                "first_low_margin_step": {str(q): Count.of(self.first_low_margin(q))
                                          for q in seqs},
                "steps": [step.summary() for step in self.steps]}


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def texts(comparison: TokenComparison) -> list[dict] | None:
    """Each sequence's generated tokens as text, the kit's and vLLM's, when the checkpoint
    folder holds a tokenizer (decoded with transformers' `AutoTokenizer`, which vLLM itself
    uses); None without one, or without tokens to decode."""
    folder = Path(comparison.folder)
    if not comparison.steps or not any((folder / n).is_file() for n in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    rows = []
    for seq in sorted({s.seq for s in comparison.steps}):
        steps = [s for s in comparison.steps if s.seq == seq]
        rows.append({"seq": seq, "kit": tokenizer.decode([s.kit_token for s in steps]),
                     "vLLM": tokenizer.decode([s.vllm_token for s in steps])})
    return rows


def kit_greedy(settings: Settings, folder: Path, prompts: list[torch.Tensor], steps: int):
    """The kit's eager paged decode on the checkpoint's weights: its run (tokens and logits
    per step), the model and the batch, for more turns."""
    arch = replace(settings.arch, checkpoint=str(folder))
    model = build_model(arch, settings.dtype, "cpu", settings.seed)
    lengths = [len(p) for p in prompts]
    # the CPU's layout: a recurrent state in the dtype vLLM's CPU engine keeps it (float32 on
    # a CPU with AVX-512 BF16, `kit.engine.hybrid_cache.state_dtypes`)
    layout = KVCacheLayout.for_model(arch, BLOCK_SIZE, settings.dtype, device="cpu")
    batch = batch_for_run(layout, lengths, steps, "cpu")
    return generate(model, batch, prompts, steps), model, batch


# Recurrent kinds vLLM's CPU engine runs in bf16 only: its delta-net kernel asserts "CPU GDN
# attention requires BF16" (`cpu_gdn_attention_core`, vllm/model_executor/layers/mamba/ops/cpu/
# gdn_attention.py)
CPU_BF16_ONLY = {"gated_delta_net": "vLLM's CPU gated delta-net runs in bf16 only"}


def token_dtypes(settings: Settings) -> tuple[list[str], dict[str, str]]:
    """The dtypes chapter 05 compares tokens in (the settings', and on the CPU float32, where
    every token must agree), and those vLLM's CPU engine cannot run this model in, each with
    why (`CPU_BF16_ONLY`)."""
    wanted = list(dict.fromkeys([settings.dtype] + (["float32"] if settings.device == "cpu"
                                                    else [])))
    recurrent = settings.arch.recurrent
    why = CPU_BF16_ONLY.get(recurrent.kind) if recurrent and settings.device == "cpu" else None
    left_out = {d: why for d in wanted if why and d != "bfloat16"}
    return [d for d in wanted if d not in left_out], left_out


def for_model(settings: Settings, model: str | None) -> Settings | None:
    """`settings` for another model (chapter 05's `moe_model`) in float32, the same batch,
    lengths and seed; None for None. Loads the model's config first: a bad name stops here."""
    return replace(settings, model=model, dtype="float32") if model else None


def compare_tokens(settings: Settings, dtype: str | None = None,
                   time_steps: bool = False) -> TokenComparison:
    """Both sides greedy on the chapter's checkpoint, `batch_size` prompts of `input_len`
    tokens, `output_len` tokens each, in `dtype` (default: the settings'); on the CPU (vLLM's
    CPU engine, in this process). With `time_steps`, the same engine then times its eager
    decode steps (`engine_timings`) and the kit its eager ones, a generation after each of
    vLLM's: the step side by side without a second engine start."""
    settings = replace(settings, dtype=dtype or settings.dtype)
    folder = chapter_checkpoint(settings)
    lengths = prompt_lengths(settings.batch_size, settings.input_len)
    prompts = make_prompts(lengths, settings.arch.vocab_size, settings.seed)
    steps = settings.output_len - 1
    run, model, batch = kit_greedy(settings, folder, prompts, steps)
    kit_steps = []

    def kit_turn():
        again = generate(model, batch, prompts, steps, keep_logits=False)
        kit_steps.extend(again.step_seconds)

    def timed(llm):
        return engine_timings(llm, len(prompts), settings.input_len, settings.output_len,
                              settings.arch.vocab_size, 2, settings.seed, kit_turn,
                              [p.tolist() for p in prompts])
    try:
        vllm = greedy_from_checkpoint(folder, [p.tolist() for p in prompts], steps + 1,
                                      settings.dtype, BLOCK_SIZE, timed if time_steps else None)
    except Exception as e:  # vLLM's refusal (a dtype its backend lacks): recorded, not raised
        return TokenComparison(settings.dtype, str(folder), error=f"{type(e).__name__}: "
                               f"{str(e).splitlines()[0] if str(e) else ''}")
    return TokenComparison(settings.dtype, str(folder), token_steps(run, vllm), None,
                           kit_steps, vllm.then.decode_steps if vllm.then else [])


def token_steps(run, vllm) -> list[TokenStep]:
    """Per sequence and step, the kit's run beside vLLM's; the kit's log-probability of vLLM's
    token only while the two have fed back the same tokens."""
    logits = run.logits.float()                          # [steps + 1, seqs, vocab]
    logprobs = torch.log_softmax(logits, -1)
    top2 = logits.topk(2, -1).values
    margins = (top2[..., 0] - top2[..., 1]) / logits.abs().amax(-1)
    out = []
    for i, tokens in enumerate(vllm.tokens):
        same = True
        for t, token in enumerate(tokens):
            out.append(TokenStep(i, t, int(run.tokens[i, t]), token,
                                 logprobs[t, i, token].item() if same else None,
                                 vllm.logprobs[i][t], margins[t, i].item()))
            same = same and out[-1].agree
    return out
