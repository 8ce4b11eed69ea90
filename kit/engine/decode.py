"""Decode over the paged KV cache (chapters 04, 05): prefill, timed decode steps, and a no-cache
reference to check them against (timing per strategy: `kit.studies.decode_timing`).

A batch of prompts is prefilled into the cache through the run's KV cache layout
(`kit.engine.kv_cache.KVCacheLayout`, which every layer is bound to) and chapter 02's block
manager (`GroupedBlockTables`: vLLM 0.32's, block 0 its null block, one table per KV cache
group); then each decode
step feeds one token per sequence, and its attention reads keys and values back through its
group's table (`kit.engine.layers.attention.paged_decode_attention`). Before each step a
sliding-window group hands back the blocks that left its window, as vLLM's sliding-window
manager does, so a model with windows holds fewer blocks than full attention would
(`PagedBatch.held`, per step). The cache is laid out as vLLM's (`kv_cache.allocate`). The step
is built to compile well: its inputs are the same tensors every step (token ids, positions,
block tables, the cache), updated in place, with shapes fixed by the batch size, the table's
width and the positions its attention reads (the batch's longest context, `max_context_len`);
there is no Python control flow on their values. So one compiled graph, or one CUDA graph,
serves every step. The prefill is a function of tensors too (`prefill_function`): eager by
default, compiled on the CPU once for any number and length of prompts
(`kit.engine.decode_runners`).

Correctness first: every strategy's logits must equal those of a run without any cache within a
tolerance by dtype (`kit.engine.no_cache`).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from kit.config import Settings
from kit.engine.block_manager import NULL_BLOCK, GroupedBlockTables
from kit.engine.kv_cache import KVCacheLayout, allocate, cache_blocks
from kit.engine.layers.attention import AttentionMetadata, attention_span
from kit.engine.layers.state_slots import allocate_states
from kit.engine.model import Decoder
from kit.errors import ConfigError
from kit.measure.device import synchronize
from kit.measure.timing import StepClock

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


def peak_blocks(layout: KVCacheLayout, lengths: list[int], steps: int) -> int:
    """Blocks a run's cache needs: vLLM's null block, and the most the sequences hold at once
    (with full attention only, at the run's end: each prompt plus the tokens fed back, in
    every group, a recurrent group's one block per sequence included; a
    sliding group hands back what leaves its window, so the run's block tables are replayed
    to find the peak)."""
    at_end = sum(g.spec.blocks_for_tokens(n + steps) for n in lengths for g in layout.groups)
    if not layout.forgets:
        return 1 + at_end
    tables = GroupedBlockTables(1 + at_end * len(layout.groups), layout.groups)
    held = []
    for i in prefill_order(lengths):
        tables.allocate_slots(i, lengths[i])
        held.append(tables.num_held_blocks)
    for _ in range(steps):
        for i in range(len(lengths)):
            tables.allocate_slots(i, 1)
            held.append(tables.num_held_blocks)
    return 1 + max(held)


def prefill_order(lengths: list[int]) -> list[int]:
    """The order sequences take their blocks in: by prompt length, as `PagedBatch.prefill`
    runs equal lengths together."""
    return sorted(range(len(lengths)), key=lambda i: (lengths[i], i))


def table_width(lengths: list[int], steps: int, block_size: int) -> int:
    """Columns of the block table: the longest sequence's blocks at the end of the run. Fixed
    for the run, so every step has the same shapes."""
    return math.ceil((max(lengths) + steps) / block_size)


def check_capacity(layout: KVCacheLayout, lengths: list[int], steps: int, num_blocks: int,
                   budget_source: str = "the KV budget") -> int:
    """Refuse a run whose tokens do not fit in `num_blocks`, saying how many are missing."""
    need = peak_blocks(layout, lengths, steps)
    if need > num_blocks:
        raise ConfigError(
            f"the run needs {need:,} KV cache blocks ({len(lengths)} sequences of up to "
            f"{max(lengths) + steps:,} tokens, {layout.block_size} tokens per block, and vLLM's "
            f"null block) but {budget_source} holds {num_blocks:,}: {need - num_blocks:,} blocks "
            "missing. Lower batch_size, "
            "input_len or output_len, or give the cache more memory (kv_cache_memory_bytes, "
            "gpu_memory_utilization, device_memory)")
    return need


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """The most likely token of each row. Taken in float32: on the CPU, argmax over bfloat16
    logits runs several times slower than the conversion and a float32 argmax together."""
    return logits.float().argmax(-1)


def from_host(src: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`src` (in host memory) ready to be copied to `device` with `non_blocking=True`, so the
    host does not wait for the device: on CUDA a fresh pinned copy, elsewhere `src` itself.

    A blocking copy from the host (`tensor.to(device)`, `copy_`, `torch.tensor(..., device=)`)
    synchronizes the stream (ATen's copy_kernel_cuda, `memcpy_and_sync`): inside a timed step
    the host would wait for every kernel queued before it. A fresh pinned tensor per copy is
    safe to drop at once: it comes from PyTorch's caching host allocator, which records an event
    on the stream of each non_blocking copy out of it and hands the block out again only once
    that event has passed (`record_event` in aten/src/ATen/native/cuda/Copy.cu), so no later
    update overwrites what an earlier copy still reads."""
    return src.pin_memory() if device.type == "cuda" and src.device.type == "cpu" else src


class PagedBatch:
    """The decode state of one batch: its blocks, and the tensors the step reads each time.

    The run's KV cache `layout` gives the groups, the block size and each layer's place in
    `kv_cache` (the model is bound to it when a run starts). `input_ids`, `positions` and
    `block_tables` ([groups, seqs, width]: a table per KV cache group) live on the device and
    are updated in place (as vLLM's persistent input buffers are), so a compiled graph or a
    CUDA graph captured on them stays valid for every step, and for every run after `start`
    resets them. `held`: the blocks the sequences hold after the
    prefill and after each step's bookkeeping.

    The block manager's tables are written to `host_tables` as the bookkeeping goes (on the
    CPU, the step's own tensor), then sent to the device in one copy per step that changed
    them, without making the host wait (`from_host`), as vLLM's persistent block tables keep a
    CPU copy: a blocking copy per sequence that opened a block would stall every step in
    which the sequences cross a block edge (with equal prompts, all at once, every
    block_size steps).
    """

    def __init__(self, layout: KVCacheLayout, kv_cache: torch.Tensor, lengths: list[int],
                 width: int, max_context_len: int | None = None):
        if layout.decode_refusal():
            raise ConfigError(layout.decode_refusal())
        # each group's tokens per block where they differ (Gemma 4's wider global layers)
        self.block_sizes = layout.decode_block_sizes
        shape = layout.tensor_shape(cache_blocks(kv_cache)[0])
        if tuple(kv_cache.shape) != shape:
            raise ValueError(f"a cache of shape {tuple(kv_cache.shape)} is not the layout's "
                             f"{shape}")
        self.layout, self.kv_cache, self.lengths = layout, kv_cache, list(lengths)
        self.block_size, self.groups = layout.block_size, layout.groups
        # positions each step's attention reads: the table's whole width unless told fewer
        self.max_context_len = max_context_len or width * self.block_size
        device = kv_cache.device
        self.block_tables = torch.full((len(self.groups), len(lengths), width), NULL_BLOCK,
                                       dtype=torch.long, device=device)
        self.positions = torch.zeros(len(lengths), dtype=torch.long, device=device)
        self.input_ids = torch.zeros(len(lengths), dtype=torch.long, device=device)
        self.host_tables = self.block_tables if device.type == "cpu" else \
            torch.full_like(self.block_tables, NULL_BLOCK, device="cpu")
        self.tables_changed = False
        self.allocator, self.held = None, []
        # a hybrid's recurrent states, in its cache's pages (kit.engine.layers.state_slots)
        self.states = allocate_states(layout, kv_cache)
        self.state_args = () if self.states is None else (self.states,)

    def step_args(self) -> tuple:
        return (self.input_ids, self.positions, self.block_tables, self.kv_cache,
                *self.state_args)

    @torch.no_grad()
    def start(self, model: Decoder, prompts: list[torch.Tensor], prefill=None) -> torch.Tensor:
        """A fresh run: every block free, the prompts prefilled into the cache (through
        `prefill`, a runner of `prefill_function(model)`; eagerly by default), each one's first
        new token (greedy) ready as the next input. Returns the prefill's logits."""
        model.bind_kv_cache(self.layout)
        self.allocator = GroupedBlockTables(cache_blocks(self.kv_cache)[0], self.groups)
        self.held = []
        self.host_tables.fill_(NULL_BLOCK)  # padding entries: the null block, the mask hides them
        self.tables_changed = True
        first = from_host(torch.tensor(self.lengths), self.kv_cache.device)
        self.positions.copy_(first, non_blocking=True)  # the first new token goes at n
        logits = self.prefill(prompts, prefill or prefill_function(model))
        self.input_ids.copy_(greedy(logits))
        return logits

    def prefill(self, prompts: list[torch.Tensor], forward) -> torch.Tensor:
        """Write every prompt's keys and values to the cache; return the logits of each
        prompt's last token [num_seqs, vocab]. Prompts of equal length go in one `forward`."""
        device = self.kv_cache.device
        logits = [None] * len(prompts)
        for length in sorted(set(self.lengths)):
            seqs = [i for i in prefill_order(self.lengths) if self.lengths[i] == length]
            slots = [[] for _ in self.groups]  # [groups, tokens]
            for i in seqs:
                self.allocator.allocate_slots(i, length)
                self.copy_tables(i)
                for g, group_slots in enumerate(slots):
                    group_slots += [self.allocator.slot(i, p, g) for p in range(length)]
            self.held.append(self.allocator.num_held_blocks)
            ids = from_host(torch.stack([prompts[i] for i in seqs]), device)
            slot_mapping = from_host(torch.tensor(slots), device)
            last = forward(ids.to(device, non_blocking=True),
                           slot_mapping.to(device, non_blocking=True), self.kv_cache,
                           *self.state_args)
            for row, i in enumerate(seqs):
                logits[i] = last[row]
        self.send_tables()  # for the first step: the prefill itself reads only slots
        return torch.stack(logits)

    def copy_tables(self, seq: int) -> None:
        """Sequence `seq`'s tables, one per group, from the block manager to `host_tables`."""
        for g, table in enumerate(self.allocator.tables[seq]):
            self.host_tables[g, seq, :len(table)] = torch.tensor(table)
        self.tables_changed = True

    def send_tables(self) -> None:
        """`host_tables` to the device's `block_tables` in one copy that does not wait for the
        device (`from_host`), when they changed since the last; on the CPU they are one tensor."""
        if self.tables_changed and self.host_tables is not self.block_tables:
            device = self.block_tables.device
            self.block_tables.copy_(from_host(self.host_tables, device), non_blocking=True)
        self.tables_changed = False

    def make_room(self) -> None:
        """Bookkeeping before a step (`GroupedBlockTables.allocate_slots`): a sliding group
        hands back the blocks that left its window, and each sequence's new token may open a
        block in every group."""
        for i in range(len(self.lengths)):
            changed = self.allocator.allocate_slots(i, 1)
            if any(changed.freed) or any(changed.new):
                self.copy_tables(i)
        self.send_tables()
        self.held.append(self.allocator.num_held_blocks)

    @torch.no_grad()
    def step(self, step) -> torch.Tensor:
        """One decode step through `step` (the step function, or a strategy's runner of it):
        bookkeeping, the step, greedy sampling fed back in place. Returns the logits."""
        self.make_room()
        logits = step(*self.step_args())
        self.input_ids.copy_(greedy(logits))
        self.positions.add_(1)
        return logits


def decode_step(model: Decoder, input_ids, positions, block_tables, kv_cache,
                max_context_len: int | None = None, states=None,
                block_sizes: tuple[int, ...] | None = None) -> torch.Tensor:
    """One decode step for the whole batch: logits [num_seqs, vocab] of the tokens `input_ids`
    at `positions`. Where each token's K and V go (its slot) and how much context each sequence
    sees follow from the positions and the block table, computed here on the device; the
    attention reads `max_context_len` positions of each (default: the table's width). A
    hybrid's recurrent layers update their `states` in place, each sequence's slot the block
    its recurrent group's table holds. `block_sizes`: each group's tokens per block where they
    differ (`KVCacheLayout.decode_block_sizes`); None: the cache's, one for every group (and
    no other function called, so the compiled step guards on nothing more)."""
    if block_sizes is None:
        block_size = cache_blocks(kv_cache)[1]
        entry = (positions // block_size)[None, :, None].expand(block_tables.shape[0], -1, 1)
        block = block_tables.gather(2, entry)[..., 0]  # [groups, seqs]
        slots = block * block_size + positions % block_size
    else:
        slots = group_slots(positions, block_tables, block_sizes)
    meta = AttentionMetadata(kv_cache, slots, block_tables, positions + 1, max_context_len,
                             states)
    return model.compute_logits(model.decode(input_ids, positions, meta))


def group_slots(positions, block_tables, block_sizes: tuple[int, ...]) -> torch.Tensor:
    """Each group's slot of each sequence's new token [groups, seqs] in the group's own tokens
    per block (a Python loop over the groups: constants to compiled code)."""
    return torch.stack([table.gather(1, (positions // size)[:, None])[:, 0] * size
                        + positions % size for table, size in zip(block_tables, block_sizes)])


def prefill_function(model: Decoder):
    """The prefill as a function of tensors (what a strategy compiles): prompts' ids
    [num_seqs, len] and their slots [groups, num_seqs * len] in, the keys and values written
    to `kv_cache` (a hybrid's final recurrent states to `states`, at the slots of its
    recurrent groups), the logits of each prompt's last token [num_seqs, vocab] out."""
    def prefill(input_ids, slot_mapping, kv_cache, states=None):
        hidden = model(input_ids, AttentionMetadata(kv_cache, slot_mapping, states=states))
        return model.compute_logits(hidden[:, -1])
    return prefill


def step_function(model: Decoder, max_context_len: int | None = None,
                  block_sizes: tuple[int, ...] | None = None):
    """`decode_step` bound to `model` (and to a batch's `max_context_len` and, where its
    groups' blocks differ, `block_sizes`): the function a strategy compiles (tensors in,
    logits out). Only a batch with `block_sizes` closes over them, so the others' compiled
    code guards on nothing more."""
    if block_sizes is None:  # (None itself, not decode_step's default: Dynamo guards those)
        def step(input_ids, positions, block_tables, kv_cache, states=None):
            return decode_step(model, input_ids, positions, block_tables, kv_cache,
                               max_context_len, states, None)
        return step

    def step_of_sizes(input_ids, positions, block_tables, kv_cache, states=None):
        return decode_step(model, input_ids, positions, block_tables, kv_cache,
                           max_context_len, states, block_sizes)
    return step_of_sizes


def step_for(model: Decoder, batch: PagedBatch):
    """`step_function` for `batch`: its max_context_len, its groups' block sizes."""
    return step_function(model, batch.max_context_len, batch.block_sizes)


# --- running and timing ----------------------------------------------------------------------

@dataclass
class Generation:
    """One greedy run: prefill, then `steps` decode steps, with every step's time."""

    prompt_lens: list[int]
    tokens: torch.Tensor          # [num_seqs, steps + 1]: the prefill's token, then each step's
    logits: torch.Tensor | None   # [steps + 1, num_seqs, vocab] (model dtype, CPU) when kept
    prefill_seconds: float
    step_seconds: list[float]


@torch.no_grad()
def generate(model: Decoder, batch: PagedBatch, prompts: list[torch.Tensor], steps: int,
             step=None, keep_logits: bool = True, prefill=None) -> Generation:
    """Prefill `prompts` into `batch`'s cache (through `prefill`, a runner of
    `prefill_function`; eagerly by default), then `steps` greedy decode steps through `step`
    (the eager step function by default, or a strategy's runner of it), each one timed. A
    step's time covers its bookkeeping (new blocks), the step and sampling, as an engine's does;
    copying out its tokens and logits for the correctness check comes after the clock."""
    device = batch.kv_cache.device.type
    step = step or step_for(model, batch)
    synchronize(device)
    t0 = time.perf_counter()
    first = batch.start(model, prompts, prefill)
    synchronize(device)
    prefill_seconds = time.perf_counter() - t0
    tokens, logits = [batch.input_ids.clone()], [first] if keep_logits else None
    clock = StepClock(device)
    for _ in range(steps):
        clock.start()
        out = batch.step(step)
        clock.stop()
        tokens.append(batch.input_ids.clone())
        if keep_logits:
            logits.append(out.clone())  # a CUDA graph's output is overwritten by its next replay
    return Generation(batch.lengths, torch.stack(tokens, 1).cpu(),
                      torch.stack(logits).cpu() if keep_logits else None,
                      prefill_seconds, clock.seconds())


def new_batch(layout: KVCacheLayout, kv_cache: torch.Tensor, lengths: list[int],
              steps: int) -> PagedBatch:
    """A batch on `kv_cache` (allocated for `layout`) whose block tables, one per KV cache
    group, are wide enough for `steps` decode steps, its attention reading as many positions
    as its longest context will hold (`attention_span`), not the table's whole width: with
    128-token blocks, 159 tokens would otherwise read 256."""
    width = table_width(lengths, steps, layout.block_size)
    span = attention_span(max(lengths) + steps, width * layout.block_size)
    return PagedBatch(layout, kv_cache, lengths, width, span)


def batch_for_run(layout: KVCacheLayout, lengths: list[int], steps: int, device: str,
                  spare_blocks: int = 0) -> PagedBatch:
    """`new_batch` on a fresh cache (`kv_cache.allocate`) holding the blocks the run needs
    (`peak_blocks`, and `spare_blocks` more)."""
    num_blocks = peak_blocks(layout, lengths, steps) + spare_blocks
    return new_batch(layout, allocate(layout, num_blocks, device), lengths, steps)


def decode_inputs(settings: Settings, layout: KVCacheLayout, kv_cache: torch.Tensor,
                  mixed: bool = False,
                  seed_offset: int = 0) -> tuple[PagedBatch, list[torch.Tensor]]:
    """The settings' batch on `kv_cache` (the run's `layout`): `batch_size` prompts of
    `input_len` tokens (or, with `mixed`, of lengths between about half of it and all of it)
    drawn from the seed, and a
    batch with room for `output_len - 1` decode steps."""
    lengths = prompt_lengths(settings.batch_size, settings.input_len, mixed)
    prompts = make_prompts(lengths, settings.arch.vocab_size, settings.seed + seed_offset)
    return new_batch(layout, kv_cache, lengths, settings.output_len - 1), prompts
