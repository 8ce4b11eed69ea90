"""Block tables (chapters 02 and 04): which cache blocks each sequence owns. No torch here.

A sequence of n tokens owns ceil(n / block_size) blocks; a block belongs to one sequence at a
time; freed blocks go back to the pool. Token `position` of a sequence lives in slot
`position % block_size` of block `table[position // block_size]`.
"""
from __future__ import annotations

import math
from collections import deque


class OutOfBlocks(RuntimeError):
    pass


class BlockAllocator:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free = deque(range(num_blocks))
        self.tables: dict[int, list[int]] = {}
        self.lengths: dict[int, int] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def _take(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfBlocks(f"need {n} blocks, {len(self._free)} free: "
                              f"{n - len(self._free)} missing")
        return [self._free.popleft() for _ in range(n)]

    def allocate(self, seq_id: int, num_tokens: int) -> list[int]:
        """Blocks for a new sequence of `num_tokens` tokens (its prompt)."""
        if seq_id in self.tables:
            raise ValueError(f"sequence {seq_id} already has blocks")
        self.tables[seq_id] = self._take(math.ceil(num_tokens / self.block_size))
        self.lengths[seq_id] = num_tokens
        return self.tables[seq_id]

    def append_token(self, seq_id: int) -> int | None:
        """One more token; returns the new block's id when the token opened one."""
        new = None
        if self.lengths[seq_id] % self.block_size == 0:
            new = self._take(1)[0]
            self.tables[seq_id].append(new)
        self.lengths[seq_id] += 1
        return new

    def free(self, seq_id: int) -> None:
        self._free.extend(self.tables.pop(seq_id))
        del self.lengths[seq_id]

    def slot(self, seq_id: int, position: int) -> int:
        """Flat slot index (block id × block_size + offset) of token `position`."""
        block = self.tables[seq_id][position // self.block_size]
        return block * self.block_size + position % self.block_size
