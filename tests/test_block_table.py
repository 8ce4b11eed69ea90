import math

import pytest
from hypothesis import given, settings, strategies as st

from kit.engine.block_table import BlockAllocator, OutOfBlocks


def invariants(a: BlockAllocator):
    owned = [b for t in a.tables.values() for b in t]
    assert len(owned) == len(set(owned)), "a block is owned twice"
    assert len(owned) + a.num_free_blocks == a.num_blocks, "blocks are not conserved"
    assert set(owned).isdisjoint(a._free)
    for seq, table in a.tables.items():
        assert len(table) == math.ceil(a.lengths[seq] / a.block_size)


ops = st.lists(st.tuples(st.sampled_from(["alloc", "append", "free"]), st.integers(0, 7),
                         st.integers(1, 70)), max_size=120)


@settings(max_examples=300, deadline=None)
@given(num_blocks=st.integers(1, 40), block_size=st.sampled_from([1, 2, 16, 32]), ops=ops)
def test_allocator_properties(num_blocks, block_size, ops):
    a = BlockAllocator(num_blocks, block_size)
    for op, seq, n in ops:
        free_before = a.num_free_blocks
        try:
            if op == "alloc" and seq not in a.tables:
                a.allocate(seq, n)
            elif op == "append" and seq in a.tables:
                a.append_token(seq)
            elif op == "free" and seq in a.tables:
                a.free(seq)
        except OutOfBlocks:
            assert a.num_free_blocks == free_before  # a refused request takes nothing
        invariants(a)
    for seq in list(a.tables):
        a.free(seq)
    assert a.num_free_blocks == num_blocks


def test_slots_follow_the_block_table():
    a = BlockAllocator(8, 4)
    a.allocate(0, 3)
    a.allocate(1, 5)
    assert a.tables == {0: [0], 1: [1, 2]}
    assert [a.slot(1, p) for p in range(5)] == [4, 5, 6, 7, 8]
    assert a.append_token(0) is None and a.append_token(0) == 3  # position 4 opens a block
    assert a.slot(0, 4) == 12


def test_out_of_blocks_says_how_many_are_missing():
    a = BlockAllocator(4, 16)
    with pytest.raises(OutOfBlocks, match="need 5 blocks, 4 free: 1 missing"):
        a.allocate(0, 65)
