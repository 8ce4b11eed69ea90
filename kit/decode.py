"""Decode over the paged KV cache (chapter 04): prefill, decode steps, a no-cache reference,
per-step timing per strategy, and the roofline floor beside it.

A batch of prompts is prefilled into the cache through chapter 02's `BlockAllocator`; then each
decode step feeds one token per sequence, and its attention reads keys and values back through
the block table (`kit.model.paged_decode_attention`). The step is built to compile well: its
inputs are the same tensors every step (token ids, positions, block tables, the cache), updated
in place, with shapes fixed by the batch size and the table's width; there is no Python
control flow on their values. So one compiled graph, or one CUDA graph, serves every step.

Correctness first: `reference_logits` recomputes every step's logits over the whole sequence
without any cache, and every strategy's logits must equal them within a tolerance by dtype.
"""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field

import torch

from kit.block_table import BlockAllocator
from kit.config import ConfigError, Settings
from kit.device import synchronize
from kit.kv_cache import KVCacheSpec, allocate
from kit.model import AttentionMetadata, Decoder

# Largest |paged - reference| allowed, relative to the reference logits' largest magnitude.
# bf16 keeps 8 bits of mantissa (0.4% per rounding); the two paths round at different places
# (one token at a time against the whole sequence), and the error grows through the layers.
TOLERANCE = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 5e-2}


# --- the batch: prompts, and the token positions they occupy in the cache -------------------

def prompt_lengths(batch_size: int, input_len: int, mixed: bool = False) -> list[int]:
    """`batch_size` prompts of `input_len` tokens, or with `mixed`, spread between about half
    of input_len and input_len (odd sizes, so they end inside blocks, not on their edges)."""
    if not mixed or batch_size == 1:
        return [input_len] * batch_size
    low = max(1, input_len // 2)
    return [low + (input_len - low) * i // (batch_size - 1) for i in range(batch_size)]


def make_prompts(lengths: list[int], vocab_size: int, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=gen) for n in lengths]


def blocks_needed(lengths: list[int], steps: int, block_size: int) -> int:
    """Blocks the whole run holds at its end: each sequence's prompt plus the tokens fed back."""
    return sum(math.ceil((n + steps) / block_size) for n in lengths)


def table_width(lengths: list[int], steps: int, block_size: int) -> int:
    """Columns of the block table: the longest sequence's blocks at the end of the run. Fixed
    for the run, so every step has the same shapes."""
    return math.ceil((max(lengths) + steps) / block_size)


def check_capacity(lengths: list[int], steps: int, block_size: int, num_blocks: int,
                   budget_source: str = "the KV budget") -> int:
    """Refuse a run whose tokens do not fit in `num_blocks`, saying how many are missing."""
    need = blocks_needed(lengths, steps, block_size)
    if need > num_blocks:
        raise ConfigError(
            f"the run needs {need:,} KV cache blocks ({len(lengths)} sequences of up to "
            f"{max(lengths) + steps:,} tokens, {block_size} tokens per block) but {budget_source} "
            f"holds {num_blocks:,}: {need - num_blocks:,} blocks missing. Lower batch_size, "
            "input_len or output_len, or give the cache more memory (kv_cache_memory_bytes, "
            "gpu_memory_utilization, device_memory)")
    return need


class PagedBatch:
    """The decode state of one batch: its blocks, and the tensors the step reads each time.

    `input_ids`, `positions` and `block_tables` live on the device and are updated in place, so
    a compiled graph or a CUDA graph captured on them stays valid for the whole run.
    """

    def __init__(self, kv_cache: torch.Tensor, lengths: list[int], width: int):
        self.kv_cache, self.lengths = kv_cache, list(lengths)
        self.block_size = kv_cache.shape[3]
        self.allocator = BlockAllocator(kv_cache.shape[2], self.block_size)
        device = kv_cache.device
        # Padding entries point at block 0: any real block will do, the mask hides them.
        self.block_tables = torch.zeros(len(lengths), width, dtype=torch.long, device=device)
        self.positions = torch.tensor(lengths, dtype=torch.long, device=device)
        self.input_ids = torch.zeros(len(lengths), dtype=torch.long, device=device)

    def step_args(self) -> tuple:
        return (self.input_ids, self.positions, self.block_tables, self.kv_cache)

    @torch.no_grad()
    def prefill(self, model: Decoder, prompts: list[torch.Tensor]) -> torch.Tensor:
        """Write every prompt's keys and values to the cache; return the logits of each
        prompt's last token [num_seqs, vocab]. Prompts of equal length go in one forward."""
        device = self.kv_cache.device
        logits = [None] * len(prompts)
        for length in sorted(set(self.lengths)):
            seqs = [i for i, n in enumerate(self.lengths) if n == length]
            slots = []
            for i in seqs:
                self.allocator.allocate(i, length)
                table = self.allocator.tables[i]
                self.block_tables[i, :len(table)] = torch.tensor(table, device=device)
                slots += [self.allocator.slot(i, p) for p in range(length)]
            meta = AttentionMetadata(self.kv_cache, torch.tensor(slots, device=device))
            ids = torch.stack([prompts[i] for i in seqs]).to(device)
            last = model.compute_logits(model(ids, meta)[:, -1])
            for row, i in enumerate(seqs):
                logits[i] = last[row]
        return torch.stack(logits)

    def make_room(self) -> None:
        """Bookkeeping before a step: each sequence's new token may open a block."""
        for i in range(len(self.lengths)):
            block = self.allocator.append_token(i)
            if block is not None:
                column = (self.allocator.lengths[i] - 1) // self.block_size
                self.block_tables[i, column] = block

    def advance(self, next_ids: torch.Tensor) -> None:
        """Feed the sampled tokens to the next step, in place."""
        self.input_ids.copy_(next_ids)
        self.positions.add_(1)


def decode_step(model: Decoder, input_ids, positions, block_tables, kv_cache) -> torch.Tensor:
    """One decode step for the whole batch: logits [num_seqs, vocab] of the tokens `input_ids`
    at `positions`. Where each token's K and V go (its slot) and how much context each sequence
    sees follow from the positions and the block table, computed here on the device."""
    block_size = kv_cache.shape[3]
    block = block_tables.gather(1, (positions // block_size)[:, None])[:, 0]
    meta = AttentionMetadata(kv_cache, block * block_size + positions % block_size,
                             block_tables, positions + 1)
    return model.compute_logits(model.decode(input_ids, positions, meta))


def step_function(model: Decoder):
    """`decode_step` bound to `model`: the function a strategy compiles (tensors in, logits out)."""
    def step(input_ids, positions, block_tables, kv_cache):
        return decode_step(model, input_ids, positions, block_tables, kv_cache)
    return step


# --- running and timing ----------------------------------------------------------------------

class StepClock:
    """Per-step times: CUDA events on a GPU (read once at the end, so timing never stalls the
    queue), a monotonic clock on the CPU."""

    def __init__(self, device: str):
        self.cuda, self.marks = device == "cuda", []

    def mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def intervals(self) -> list[float]:
        """Seconds between consecutive marks."""
        if self.cuda:
            self.marks[-1].synchronize()
            return [a.elapsed_time(b) / 1e3 for a, b in zip(self.marks, self.marks[1:])]
        return [b - a for a, b in zip(self.marks, self.marks[1:])]


@dataclass
class Generation:
    """One greedy run: prefill, then `steps` decode steps, with every step's time."""

    prompt_lens: list[int]
    tokens: torch.Tensor          # [num_seqs, steps + 1]: the prefill's token, then each step's
    logits: torch.Tensor | None   # [steps + 1, num_seqs, vocab] when kept
    prefill_seconds: float
    step_seconds: list[float]

    @property
    def context_lens(self) -> list[list[int]]:
        """Tokens each sequence attends to at each decode step (its new one included)."""
        return [[n + t + 1 for n in self.prompt_lens] for t in range(len(self.step_seconds))]


@torch.no_grad()
def generate(model: Decoder, kv_cache: torch.Tensor, prompts: list[torch.Tensor], steps: int,
             step=None, keep_logits: bool = True) -> Generation:
    """Prefill `prompts` into `kv_cache`, then `steps` greedy decode steps through `step` (the
    eager `decode_step` by default, or a strategy's runner of it). Each step's time covers its
    bookkeeping (new blocks), the step, and sampling, as an engine's step does."""
    device = str(kv_cache.device.type)
    lengths = [len(p) for p in prompts]
    batch = PagedBatch(kv_cache, lengths, table_width(lengths, steps, kv_cache.shape[3]))
    step = step or step_function(model)
    synchronize(device)
    t0 = time.perf_counter()
    first = batch.prefill(model, prompts)
    batch.input_ids.copy_(first.argmax(-1))  # the first new token goes at position n: no advance
    synchronize(device)
    prefill_seconds = time.perf_counter() - t0
    tokens, logits = [batch.input_ids.clone()], [first.clone()] if keep_logits else None
    clock = StepClock(device)
    clock.mark()
    for _ in range(steps):
        batch.make_room()
        out = step(*batch.step_args())
        batch.advance(out.argmax(-1))
        clock.mark()
        tokens.append(batch.input_ids.clone())  # after the mark: not part of the step
        if keep_logits:
            logits.append(out.clone())  # a CUDA graph's output is overwritten by the next replay
    return Generation(lengths, torch.stack(tokens, 1).cpu(),
                      torch.stack(logits).float().cpu() if keep_logits else None,
                      prefill_seconds, clock.intervals())


@torch.no_grad()
def reference_logits(model: Decoder, prompts: list[torch.Tensor], tokens: torch.Tensor,
                     steps: int) -> torch.Tensor:
    """The logits a run must have produced, recomputed without any cache: each sequence (its
    prompt and the tokens fed back) in one causal forward over the whole sequence; causality
    makes position n + t - 1 hold step t's logits. -> [steps + 1, num_seqs, vocab]."""
    device = next(model.parameters()).device
    out = []
    for prompt, fed in zip(prompts, tokens[:, :steps]):
        ids = torch.cat([prompt, fed]).to(device)[None]
        hidden = model(ids)[0, len(prompt) - 1:]
        out.append(model.compute_logits(hidden).float().cpu())
    return torch.stack(out, 1)


def logits_error(logits: torch.Tensor, reference: torch.Tensor) -> list[float]:
    """Per step: max |logits - reference| / max |reference|."""
    diff = (logits - reference).abs().flatten(1).amax(1)
    return (diff / reference.abs().flatten(1).amax(1)).tolist()


@dataclass
class Correctness:
    """How far a paged run's logits are from the no-cache reference, step by step."""

    dtype: str
    tolerance: float
    errors: list[float]            # step 0 is the prefill, then each decode step
    tokens_agree: bool             # does the reference pick the same greedy tokens?

    @property
    def max_error(self) -> float:
        return max(self.errors)

    @property
    def ok(self) -> bool:
        return self.max_error <= self.tolerance

    def summary(self) -> dict:
        return {"dtype": self.dtype, "tolerance": self.tolerance, "max_error": self.max_error,
                "ok": self.ok, "tokens_agree": self.tokens_agree, "errors": self.errors}


def check_against_reference(model: Decoder, prompts, run: Generation, dtype: str) -> Correctness:
    """Compare every step's logits of `run` with the no-cache reference."""
    steps = len(run.step_seconds)
    ref = reference_logits(model, prompts, run.tokens, steps)
    agree = bool((ref.argmax(-1) == run.logits.argmax(-1)).float().mean() > 0.9)
    return Correctness(dtype, TOLERANCE[dtype], logits_error(run.logits, ref), agree)


def quantile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


@dataclass
class StrategyTiming:
    """One strategy's decode run: warm-up (compilation included) apart from the timed steps."""

    strategy: str
    compile_seconds: float         # the first call of the step (compiles, or captures a graph)
    warmup_seconds: float          # the whole warm-up run: its prefill, steps and compilation
    prefill_seconds: float
    step_seconds: list[float]
    num_seqs: int
    correctness: Correctness | None = None
    floor_seconds: list[float] = field(default_factory=list)  # per step, set by the roofline

    @property
    def median(self) -> float:
        return statistics.median(self.step_seconds)

    @property
    def p10(self) -> float:
        return quantile(self.step_seconds, 0.1)

    @property
    def p90(self) -> float:
        return quantile(self.step_seconds, 0.9)

    @property
    def spread(self) -> float:
        return self.p90 - self.p10

    @property
    def end_to_end_seconds(self) -> float:
        return self.prefill_seconds + sum(self.step_seconds)

    @property
    def tokens_per_second(self) -> float:
        """Generated tokens (the prefill's one and each step's) per second, end to end."""
        return self.num_seqs * (len(self.step_seconds) + 1) / self.end_to_end_seconds

    @property
    def percent_of_floor(self) -> float | None:
        """The bandwidth floor as % of the measured step time (median over the steps): 100%
        means the step moves its bytes as fast as a plain copy does."""
        if not self.floor_seconds:
            return None
        return 100 * statistics.median(f / s for f, s in zip(self.floor_seconds,
                                                              self.step_seconds))

    def summary(self) -> dict:
        return {"strategy": self.strategy, "compile_seconds": self.compile_seconds,
                "warmup_seconds": self.warmup_seconds, "prefill_seconds": self.prefill_seconds,
                "median_step_seconds": self.median, "p10_step_seconds": self.p10,
                "p90_step_seconds": self.p90, "spread_seconds": self.spread,
                "end_to_end_seconds": self.end_to_end_seconds,
                "tokens_per_second": self.tokens_per_second,
                "percent_of_floor": self.percent_of_floor, "step_seconds": self.step_seconds,
                "floor_seconds": self.floor_seconds,
                "correctness": self.correctness.summary() if self.correctness else None}


def kv_cache_for(settings: Settings, num_blocks: int) -> torch.Tensor:
    """The cache tensor ([num_layers, 2, num_blocks, block_size, kv_heads, head_dim])."""
    return allocate(KVCacheSpec.from_settings(settings), num_blocks, settings.dtype,
                    settings.device)
