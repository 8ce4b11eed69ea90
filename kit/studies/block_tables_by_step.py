"""Chapter 02, block tables per KV cache group: a batch prefilled and decoded through
`GroupedBlockTables` (vLLM 0.32's `KVCacheManager`, prefix caching off), one sequence's tables
recorded after every step, so the chapter shows window groups handing back blocks as the
window moves on while full-attention groups keep theirs.
"""
from __future__ import annotations

from dataclasses import dataclass

from kit.config import ModelConfig, with_layer_pattern
from kit.engine.block_manager import NULL_BLOCK, GroupedBlockTables, StepBlocks
from kit.engine.kv_cache import KVCacheLayout
from kit.engine.kv_groups import KVCacheGroup


@dataclass(frozen=True)
class TableStep:
    """One step of the watched sequence: step 0 is its prefill, then one decode step each."""

    step: int
    num_computed_tokens: int                  # tokens in its cache after the step
    tables: tuple[tuple[int, ...], ...]       # its table per group (0: null block, handed back)
    freed: tuple[tuple[int, ...], ...]        # handed back this step, per group
    new: tuple[tuple[int, ...], ...]          # taken this step, per group
    num_free_blocks: int                      # the pool's, after the whole batch's step


@dataclass(frozen=True)
class TableSteps:
    """Chapter 02's per-step block tables for one sequence of a batch."""

    model: str
    groups: tuple[KVCacheGroup, ...]
    block_size: int
    num_blocks: int
    prompt_lens: tuple[int, ...]
    steps: tuple[TableStep, ...]

    @property
    def blocks(self) -> str:
        """Tokens per block, for titles: each group's where they differ (vLLM gives layers of
        smaller pages more tokens per block)."""
        sizes = sorted({g.spec.block_size for g in self.groups})
        return " or ".join(map(str, sizes)) + " tokens" + (" by group" if len(sizes) > 1 else "")

    def rows(self) -> list[dict]:
        """One row per step and group: what the chapter's table and checks read."""
        return [{"step": s.step, "tokens": s.num_computed_tokens, "group": g,
                 "window": self.groups[g].window,
                 "held": sum(b != NULL_BLOCK for b in s.tables[g]),
                 "null": s.tables[g].count(NULL_BLOCK), "freed": list(s.freed[g]),
                 "new": list(s.new[g]), "free blocks": s.num_free_blocks}
                for s in self.steps for g in range(len(self.groups))]


def default_prompt_len(groups: tuple[KVCacheGroup, ...], block_size: int) -> int:
    """The smallest window plus a block of its group less one token (its first block goes
    back at the first decode step), or two blocks when no layer has a window."""
    windowed = [g for g in groups if g.window is not None]
    if not windowed:
        return 2 * block_size
    first = min(windowed, key=lambda g: g.window)
    return first.window + first.spec.block_size - 1


def _record(tables: GroupedBlockTables, step: int, watched: StepBlocks) -> TableStep:
    return TableStep(step, tables.num_computed_tokens[0],
                     tuple(tuple(t) for t in tables.tables[0]), watched.freed, watched.new,
                     tables.num_free_blocks)


def pool_without_hand_back(layout: KVCacheLayout, prompts: tuple[int, ...],
                           decode_steps: int) -> int:
    """A pool just large enough for the batch with no block handed back, the null block
    counted: small, so the figure's free count moves visibly."""
    per_seq = [layout.blocks_for(n + decode_steps) for n in prompts]
    return len(layout.groups) * sum(per_seq) + 1


def table_steps(arch: ModelConfig, block_size: int, num_blocks: int | None = None,
                batch_size: int = 2, prompt_len: int | None = None,
                decode_steps: int | None = None) -> TableSteps:
    """Prefill `batch_size` prompts (`prompt_len`, then 7 tokens shorter each; default: just
    past the smallest window), then `decode_steps` decode steps for all (default: enough for
    the watched sequence's window to drop three blocks); returns sequence 0's tables after
    each step, in `arch`'s KV cache at `block_size` (`KVCacheLayout`). `num_blocks` defaults to
    `pool_without_hand_back`. For a model without windows, try
    `kit.config.with_layer_pattern(arch, full_every, sliding_window)`."""
    layout = KVCacheLayout.for_model(arch, block_size, "bfloat16")  # bytes play no part here
    groups = layout.groups
    prompt_len = prompt_len or default_prompt_len(groups, block_size)
    decode_steps = 2 * block_size + 1 if decode_steps is None else decode_steps
    prompts = tuple(max(1, prompt_len - 7 * i) for i in range(batch_size))
    num_blocks = num_blocks or pool_without_hand_back(layout, prompts, decode_steps)
    tables = GroupedBlockTables(num_blocks, groups)
    watched = [tables.allocate_slots(seq, n) for seq, n in enumerate(prompts)][0]
    steps = [_record(tables, 0, watched)]
    for step in range(1, decode_steps + 1):
        watched = [tables.allocate_slots(seq, 1) for seq in range(batch_size)][0]
        steps.append(_record(tables, step, watched))
    return TableSteps(arch.name, groups, block_size, num_blocks, prompts, tuple(steps))


def windowed_example(arch: ModelConfig, window: int = 20) -> ModelConfig:
    """`arch` with every second layer sliding over `window` tokens, the chapter's example of
    groups handing back blocks; a model whose layers are not all attention (latent attention,
    a hybrid's recurrent layers: `Parts.sized_only`) takes no window pattern, so the default
    preset's model (`tiny`) stands in for it. (Gemma 4 with wider global layers keeps its
    own: its sliding groups' blocks hold more tokens, `TableSteps.blocks`.)"""
    return with_layer_pattern(ModelConfig.load("tiny") if arch.parts.sized_only else arch, 2,
                              window)
