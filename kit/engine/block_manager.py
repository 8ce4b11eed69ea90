"""The block manager (chapters 02, 04, 05): vLLM 0.32's `KVCacheManager` with prefix caching
off, one block table per KV cache group for each sequence. No torch here.

A sequence of n tokens holds ceil(n / block_size) blocks in each group's table; a block belongs
to one sequence at a time; blocks handed back go to the pool. One pool of block ids serves every
group (`kit.engine.kv_groups`). Block 0 is vLLM's null block: never handed out, it stands in a
table where a block was handed back (`BlockPool.null_block`). A layer finds token `position` of
a sequence in its group's table: slot `position % block_size` of block
`table[position // block_size]`.

Each step (`allocate_slots`), before taking new blocks, a sliding-window group hands back the
blocks that lie wholly before its window: after c computed tokens the next token sees the last
W of them, so the first c − W + 1 tokens are skipped (`SlidingWindowManager.
get_num_skipped_tokens`) and the (c − W + 1) // block_size blocks that hold only skipped tokens
go back to the pool, replaced by the null block (`remove_skipped_blocks`). A full-attention
group keeps every block until the sequence ends. A prefill longer than the window still takes
blocks for its whole prompt: they are handed back at the first decode step.

Steps run as a synchronous scheduler runs them: a step's tokens are processed before the next
step is scheduled. (With async scheduling vLLM frees on the processed tokens only,
`computed − num_in_flight_tokens`, so a window's blocks go back one step later.)

Free blocks are reused last-in first-out, as vLLM's free block queue does for blocks without a
prefix-cache hash (`BlockPool.free_blocks` prepends them).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from kit.engine.kv_groups import KVCacheGroup

NULL_BLOCK = 0  # vLLM's null block: reserved, fills the table entries handed back


class OutOfBlocks(RuntimeError):
    pass


@dataclass(frozen=True)
class StepBlocks:
    """What one `allocate_slots` call did to one sequence, per group (in the groups' order)."""

    freed: tuple[tuple[int, ...], ...]  # handed back (now null block entries)
    new: tuple[tuple[int, ...], ...]    # taken from the pool for this step's tokens


class FreeBlockQueue:
    """vLLM's `FreeKVCacheBlockQueue` without prefix caching: take from the front, hand back to
    the front (the last block handed back is the next taken)."""

    def __init__(self, num_blocks: int):
        self._queue = deque(range(NULL_BLOCK + 1, num_blocks))

    def __len__(self) -> int:
        return len(self._queue)

    def __contains__(self, block: int) -> bool:
        return block in self._queue

    def take(self, n: int) -> list[int]:
        """`BlockPool.get_new_blocks`."""
        if n > len(self._queue):
            raise OutOfBlocks(f"need {n} blocks, {len(self._queue)} free: "
                              f"{n - len(self._queue)} missing")
        return [self._queue.popleft() for _ in range(n)]

    def give_back(self, blocks: list[int]) -> None:
        """`BlockPool.free_blocks`: `blocks` go to the front, in their order."""
        self._queue.extendleft(reversed([b for b in blocks if b != NULL_BLOCK]))


class GroupedBlockTables:
    """One pool of `num_blocks` block ids (block 0 the null block) and, for each sequence, one
    block table per KV cache group (`groups`, a layout's: their specs give the block size and
    what each group forgets): vLLM's `KVCacheManager.allocate_slots` and `free`."""

    def __init__(self, num_blocks: int, groups: tuple[KVCacheGroup, ...]):
        if num_blocks < 2 or not groups:
            raise ValueError("need num_blocks >= 2 (one is the null block) and at least one group")
        # tokens per block: each group's own where they differ (vLLM gives layers of smaller
        # pages more tokens per block, so every block id is one page in every group)
        self.num_blocks, self.groups = num_blocks, tuple(groups)
        self.block_size = min(g.spec.block_size for g in groups)
        self.pool = FreeBlockQueue(num_blocks)
        self.tables: dict[int, tuple[list[int], ...]] = {}
        self.num_computed_tokens: dict[int, int] = {}

    @property
    def num_free_blocks(self) -> int:
        """Free blocks, the null block not counted (`BlockPool.get_num_free_blocks`)."""
        return len(self.pool)

    @property
    def num_held_blocks(self) -> int:
        """Blocks the sequences hold, across groups (the null block not counted)."""
        return self.num_blocks - 1 - self.num_free_blocks

    def remove_skipped_blocks(self, seq_id: int) -> tuple[tuple[int, ...], ...]:
        """Hand back each group's blocks that hold only skipped tokens, last block first,
        replacing them with the null block (`SingleTypeKVCacheManager.remove_skipped_blocks`
        and `_remove_blocks_in_range`); returns them per group."""
        computed = self.num_computed_tokens[seq_id]
        freed_per_group = []
        for group, table in zip(self.groups, self.tables[seq_id]):
            skipped = min(group.spec.num_skipped_tokens(computed) // group.spec.block_size,
                          len(table))
            freed = []
            for i in range(skipped - 1, -1, -1):
                if table[i] == NULL_BLOCK:
                    break  # handed back at an earlier step, and everything before it
                freed.append(table[i])
                table[i] = NULL_BLOCK
            self.pool.give_back(freed)
            freed_per_group.append(tuple(freed))
        return tuple(freed_per_group)

    def admits(self, num_tokens: int, max_model_len: int, in_flight_tokens: int) -> bool:
        """Whether a new request of `num_tokens` tokens is admitted: the blocks it needs, a
        window's or chunk's no more than a request reserves, are free
        (`KVCacheManager.allocate_slots` with `full_sequence_must_fit`, as the scheduler calls
        it for a waiting request)."""
        need = sum(g.spec.admission_blocks(num_tokens, max_model_len, in_flight_tokens)
                   for g in self.groups)
        return need <= self.num_free_blocks

    def blocks_to_allocate(self, seq_id: int, num_new_tokens: int) -> int:
        """New blocks the next `num_new_tokens` tokens need across groups
        (`get_num_blocks_to_allocate` for a running request)."""
        total = self.num_computed_tokens[seq_id] + num_new_tokens
        return sum(max(group.spec.blocks_for_tokens(total) - len(table), 0)
                   for group, table in zip(self.groups, self.tables[seq_id]))

    def allocate_slots(self, seq_id: int, num_new_tokens: int) -> StepBlocks:
        """Slots for `num_new_tokens` more tokens of `seq_id` (a new sequence: its prompt, or a
        chunk of it): first the skipped blocks go back, then each group takes the blocks it
        lacks, group by group (`KVCacheManager.allocate_slots`). The tokens then count as
        computed. Raises `OutOfBlocks` when the pool is short, after handing back the skipped
        blocks and taking nothing, as vLLM does."""
        if seq_id not in self.tables:
            self.tables[seq_id] = tuple([] for _ in self.groups)
            self.num_computed_tokens[seq_id] = 0
        freed = self.remove_skipped_blocks(seq_id)
        need = self.blocks_to_allocate(seq_id, num_new_tokens)
        if need > self.num_free_blocks:
            if self.num_computed_tokens[seq_id] == 0:  # a new sequence leaves no trace
                del self.tables[seq_id], self.num_computed_tokens[seq_id]
            raise OutOfBlocks(f"need {need} blocks, {self.num_free_blocks} free: "
                              f"{need - self.num_free_blocks} missing")
        total = self.num_computed_tokens[seq_id] + num_new_tokens
        new = []
        for group, table in zip(self.groups, self.tables[seq_id]):
            blocks = self.pool.take(max(group.spec.blocks_for_tokens(total) - len(table), 0))
            table.extend(blocks)
            new.append(tuple(blocks))
        self.num_computed_tokens[seq_id] = total
        return StepBlocks(freed, tuple(new))

    def free(self, seq_id: int) -> None:
        """Hand back all of a finished sequence's blocks: group by group, each table last block
        first (`KVCacheCoordinator.free`, `SingleTypeKVCacheManager.free`)."""
        for table in self.tables.pop(seq_id):
            self.pool.give_back(table[::-1])
        del self.num_computed_tokens[seq_id]

    def slot(self, seq_id: int, position: int, group: int) -> int:
        """Flat slot index (block id × block_size + offset) of token `position` for the layers
        of group `group`; a position handed back (null block) is refused. A recurrent group's
        one block holds the sequence's state: every position maps into it."""
        table, size = self.tables[seq_id][group], self.groups[group].spec.block_size
        block = table[0] if self.groups[group].spec.blocks_for_tokens(position + 1) == 1 \
            else table[position // size]
        if block == NULL_BLOCK:
            raise ValueError(f"position {position} of sequence {seq_id} left group {group}'s "
                             "window: its block was handed back")
        return block * size + position % size
