"""The block manager (chapters 02, 04, 05): block tables per KV cache group, their invariants,
and step by step against vLLM 0.32's own `KVCacheManager` (prefix caching off): the same block
ids in every group's table, null-block entries included, and the same free count after every
call. Nothing of vLLM's is copied: its groups come from its `get_kv_cache_groups` on one spec
per layer, its requests are `Request`s. The torch-free properties run without vLLM."""
import re

import pytest
from hypothesis import given, settings, strategies as st

from kit.config import ModelConfig
from kit.engine.block_manager import NULL_BLOCK, GroupedBlockTables, OutOfBlocks
from kit.engine.kv_groups import kv_cache_groups
from kit.engine.kv_specs import attention_specs
from kit.vllm.installed import vllm_missing

GEMMA3 = (7,) * 5 + (None,)           # 5 sliding : 1 full
GEMMA2 = (10, None) * 3               # alternating
MISTRAL = (6,) * 6                    # all sliding
FULL = (None,) * 4
LLAMA4 = (("chunk", 16),) * 3 + (None,)  # 3 chunked local : 1 full (NoPE)


def groups_of(windows, block_size: int):
    """The KV cache groups of layers with these windows (None: full attention; ("chunk", C):
    Llama 4's chunked local attention)."""
    chunks = [w[1] if isinstance(w, tuple) else None for w in windows]
    windows = [None if isinstance(w, tuple) else w for w in windows]
    return kv_cache_groups(attention_specs(windows, block_size, 1, 8, 2, chunks))


def invariants(t: GroupedBlockTables):
    held = [b for tables in t.tables.values() for table in tables for b in table
            if b != NULL_BLOCK]
    assert len(held) == len(set(held)), "a block is held twice"
    assert len(held) + t.num_free_blocks == t.num_blocks - 1, "blocks are not conserved"
    assert NULL_BLOCK not in t.pool
    for seq, tables in t.tables.items():
        computed = t.num_computed_tokens[seq]
        for group, table in zip(t.groups, tables):
            assert len(table) == -(-computed // group.spec.block_size)
            nulls = table.count(NULL_BLOCK)
            assert table[:nulls] == [NULL_BLOCK] * nulls  # only a prefix is handed back
            if group.window is None:
                assert nulls == 0


ops = st.lists(st.tuples(st.sampled_from(["step", "step", "free"]), st.integers(0, 4),
                         st.integers(1, 40)), max_size=80)


@settings(max_examples=200, deadline=None)
@given(windows=st.sampled_from([GEMMA3, GEMMA2, MISTRAL, FULL]), num_blocks=st.integers(2, 80),
       block_size=st.sampled_from([1, 2, 4, 16]), ops=ops)
def test_tables_properties(windows, num_blocks, block_size, ops):
    t = GroupedBlockTables(num_blocks, groups_of(windows, block_size))
    for op, seq, n in ops:
        free_before = t.num_free_blocks
        try:
            if op == "step":
                t.allocate_slots(seq, n if seq not in t.tables else 1)
            elif seq in t.tables:
                t.free(seq)
        except OutOfBlocks:
            assert t.num_free_blocks >= free_before  # only handed-back blocks moved
        invariants(t)
    for seq in list(t.tables):
        t.free(seq)
    assert t.num_free_blocks == num_blocks - 1


def test_a_window_hands_back_what_falls_out_of_it():
    """Window 7, blocks of 4: after c tokens, blocks wholly below c - 6 go back."""
    t = GroupedBlockTables(40, groups_of(GEMMA3, 4))
    t.allocate_slots(0, 10)
    assert t.tables[0][0] == [1, 2, 3] and t.tables[0][5] == [16, 17, 18]
    step = t.allocate_slots(0, 1)  # 10 computed: tokens 0-3 skipped
    assert step.freed == ((1,), (4,), (7,), (10,), (13,), ())
    assert t.tables[0][0] == [NULL_BLOCK, 2, 3] and t.tables[0][5] == [16, 17, 18]
    t.allocate_slots(0, 1)
    step = t.allocate_slots(0, 1)  # 12 computed: still one block skipped; 13th token opens one
    assert step.freed == ((),) * 6
    # the last handed back is the first taken: group 4's block 13 goes to group 0
    assert step.new == ((13,), (10,), (7,), (4,), (1,), (19,))
    with pytest.raises(ValueError, match="window"):
        t.slot(0, 2, 0)
    assert t.slot(0, 2, 5) == 16 * 4 + 2


def test_full_attention_is_one_table_as_before():
    t = GroupedBlockTables(10, groups_of(FULL, 4))
    t.allocate_slots(0, 9)
    assert t.tables[0] == ([1, 2, 3],)
    assert [t.slot(0, p, 0) for p in (0, 8)] == [4, 12]
    assert t.allocate_slots(0, 1).freed == ((),)


def test_slots_follow_the_block_table():
    t = GroupedBlockTables(9, groups_of(FULL, 4))
    t.allocate_slots(0, 3)
    t.allocate_slots(1, 5)
    assert t.tables == {0: ([1],), 1: ([2, 3],)}
    assert [t.slot(1, p, 0) for p in range(5)] == [8, 9, 10, 11, 12]
    assert t.allocate_slots(0, 1).new == ((),)
    assert t.allocate_slots(0, 1).new == ((4,),)  # position 4 opens a block
    assert t.slot(0, 4, 0) == 16


def test_out_of_blocks_says_how_many_are_missing_and_takes_nothing():
    t = GroupedBlockTables(5, groups_of(FULL, 16))  # 4 usable beside the null block
    with pytest.raises(OutOfBlocks, match="need 5 blocks, 4 free: 1 missing"):
        t.allocate_slots(0, 65)
    assert t.num_free_blocks == 4 and 0 not in t.tables


def test_groups_of_different_block_sizes_share_one_pool():
    """Gemma 4 with wider global layers: vLLM gives the layers of smaller pages more tokens per
    block (a window group of 32-token blocks beside a full group of 16, one page size). Each
    group's table holds its own ⌈n ÷ its block⌉ blocks from the one pool, hands back its own
    skipped blocks, and finds a position in its own blocks."""
    from kit.engine.kv_specs import FullAttentionSpec, SlidingWindowSpec
    specs = [SlidingWindowSpec(32, 1, 8, 2, sliding_window=40), FullAttentionSpec(16, 2, 8, 2)]
    assert specs[0].page_size_bytes == specs[1].page_size_bytes
    t = GroupedBlockTables(40, kv_cache_groups(specs))
    step = t.allocate_slots(0, 70)
    assert [len(blocks) for blocks in step.new] == [3, 5]  # ⌈70/32⌉ and ⌈70/16⌉
    window, full = t.tables[0]
    assert t.slot(0, 69, 0) == window[2] * 32 + 5 and t.slot(0, 69, 1) == full[4] * 16 + 5
    first = window[0]
    assert t.allocate_slots(0, 10).freed == ((), ())  # 70 computed: 31 skipped, no whole block
    assert t.allocate_slots(0, 1).freed == ((first,), ())  # 80: 41 skipped, block 0 goes
    invariants(t)


def test_chapter_steps_show_the_window_handing_back_blocks():
    """Gemma-3-1B's shape (window 512, 6 window groups and 1 full), blocks of 32: the watched
    sequence's window groups hand back one block at steps 1, 33 and 65, and the block a window
    hands back is the next one taken; the full group keeps every block."""
    from kit.studies.block_tables_by_step import table_steps
    result = table_steps(ModelConfig.load("gemma-3-1b"), 32)
    assert [g.window for g in result.groups] == [512] * 6 + [None]
    freed = {s.step for s in result.steps if any(s.freed)}
    assert freed == {1, 33, 65}
    one, two = result.steps[1], result.steps[2]
    assert all(len(f) == 1 for f in one.freed[:6]) and one.freed[6] == ()
    assert two.new[0] == one.freed[5]  # last handed back, first taken (vLLM's LIFO queue)
    rows = result.rows()
    assert [r["null"] for r in rows if r["group"] == 0 and r["step"] in (0, 1, 33, 65)] \
        == [0, 1, 2, 3]
    assert all(r["null"] == 0 for r in rows if r["window"] is None)
    full = table_steps(ModelConfig.load("tiny"), 32)  # no window: one group, nothing back
    assert len(full.groups) == 1 and not any(s.freed[0] for s in full.steps)


def test_chapter_figure_and_table_draw_what_the_steps_hold():
    from kit.show.kv_cache_plots import group_tables_steps
    from kit.show.kv_cache_tables import group_steps_table
    from kit.studies.block_tables_by_step import table_steps
    result = table_steps(ModelConfig.load("gemma-2-2b"), 32, prompt_len=4200, decode_steps=40)
    fig = group_tables_steps(result)
    maps = [t for t in fig.data if t.type == "heatmap"]
    assert len(maps) == len(result.groups) == 2
    handed_back = sum(row.count(1) for row in maps[0].z)
    assert handed_back == sum(len(s.freed[0]) for s in result.steps) > 0
    assert all(row.count(1) == 0 for row in maps[1].z)  # the full group hands nothing back
    table = group_steps_table(result)
    assert [r["step"] for r in table.rows] == [s.step for s in result.steps
                                               if s.step == 0 or any(s.freed + s.new)]
    assert "−[" in repr(table) and "free blocks" in table.columns


# --- against vLLM -------------------------------------------------------------------------------

def vllm_manager(windows, block_size: int, num_blocks: int):
    """vLLM's KVCacheManager for layers with these windows, its groups made by vLLM."""
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import get_kv_cache_groups
    from vllm.v1.kv_cache_interface import (ChunkedLocalAttentionSpec, FullAttentionSpec,
                                            KVCacheConfig, SlidingWindowSpec)

    def spec(window):
        kw = dict(block_size=block_size, num_kv_heads=1, head_size=8, dtype=torch.float32)
        if isinstance(window, tuple):
            return ChunkedLocalAttentionSpec(attention_chunk_size=window[1], **kw)
        return FullAttentionSpec(**kw) if window is None else \
            SlidingWindowSpec(sliding_window=window, **kw)

    config = VllmConfig()
    config.cache_config.kv_cache_layout = "NHD"  # the engine core resolves it from its backend
    specs = {f"model.layers.{i}.self_attn.attn": spec(w) for i, w in enumerate(windows)}
    groups = get_kv_cache_groups(config, specs)
    return KVCacheManager(KVCacheConfig(num_blocks, [], groups), max_model_len=1 << 16,
                          scheduler_block_size=block_size, hash_block_size=block_size,
                          enable_caching=False), groups


def vllm_group_layers(groups) -> list[tuple[tuple[int, ...], int | None]]:
    return [(tuple(int(re.search(r"\d+", n)[0]) for n in g.layer_names),
             getattr(g.kv_cache_spec, "sliding_window", None)) for g in groups]


class Pair:
    """The kit's tables and vLLM's manager driven by the same calls, compared after each."""

    def __init__(self, windows, block_size: int, num_blocks: int):
        self.vllm, groups = vllm_manager(windows, block_size, num_blocks)
        self.kit = GroupedBlockTables(num_blocks, groups_of(windows, block_size))
        assert vllm_group_layers(groups) == [(g.layers, g.window) for g in self.kit.groups]
        self.requests, self.log = {}, []

    def step(self, seq: int, num_new_tokens: int, prompt_len: int = 0) -> bool:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request
        if seq not in self.requests:
            self.requests[seq] = Request(str(seq), list(range(prompt_len)), SamplingParams(),
                                         None)
        request = self.requests[seq]
        got = self.vllm.allocate_slots(request, num_new_tokens)
        try:
            self.kit.allocate_slots(seq, num_new_tokens)
            assert got is not None, f"vLLM refused seq {seq}, the kit did not"
        except OutOfBlocks:
            assert got is None, f"the kit refused seq {seq}, vLLM did not"
            self.compare()
            return False
        request.num_computed_tokens += num_new_tokens
        if request.num_computed_tokens >= request.num_prompt_tokens:
            request.append_output_token_ids(7)
        self.compare()
        return True

    def free(self, seq: int):
        self.vllm.free(self.requests.pop(seq))
        self.kit.free(seq)
        self.compare()

    def compare(self):
        for seq in self.requests:
            theirs = [list(t) for t in self.vllm.get_block_ids(str(seq))]
            ours = list(self.kit.tables.get(seq, ()))
            assert ours == theirs or (not ours and not any(theirs)), (seq, ours, theirs)
        assert self.kit.num_free_blocks == self.vllm.block_pool.get_num_free_blocks()
        self.log.append(self.kit.num_free_blocks)


def serve(pair: Pair, prompts: list[int], steps: int, chunk: int = 1 << 16,
          finish_at: dict | None = None):
    """Prefill each prompt (in chunks of `chunk` tokens), then `steps` decode steps for every
    running sequence; sequence s finishes after decode step `finish_at[s]`."""
    finish_at = finish_at or {}
    for seq, n in enumerate(prompts):
        for start in range(0, n, chunk):
            pair.step(seq, min(chunk, n - start), n)
    for k in range(steps):
        for seq in list(pair.requests):
            pair.step(seq, 1)
            if finish_at.get(seq) == k:
                pair.free(seq)


def against_vllm(test):
    return pytest.mark.vllm(pytest.mark.skipif(vllm_missing() is not None,
                                               reason=str(vllm_missing()))(test))

SHAPES = {"gemma3-like": GEMMA3, "gemma2-like": GEMMA2, "mistral-like": MISTRAL, "full": FULL,
          "llama4-like": LLAMA4}


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("chunk", [1 << 16, 5])
@against_vllm
def test_tables_equal_vllms_step_by_step(shape, block_size, chunk):
    """Three requests, prompts shorter and longer than the windows (7, 10, 6: not multiples
    of the block), one finishing early and one arriving after it, 30 decode steps."""
    pair = Pair(SHAPES[shape], block_size, 400)
    serve(pair, [3, 23, 41], 30, chunk, finish_at={1: 12})
    pair.step(3, 19, 19)  # arrives in the blocks the finished one handed back
    serve_more = [pair.step(seq, 1) for _ in range(10) for seq in list(pair.requests)]
    assert all(serve_more) and len(pair.log) > 100


@against_vllm
def test_both_refuse_together_when_the_pool_runs_short():
    """79 free blocks; 6 groups hold 9 + 3 blocks each for prompts of 33 and 9 tokens: 7 left,
    a third prompt of 9 is refused. One decode step of the first hands back 6 blocks in each
    of its 5 window groups, and the third fits."""
    pair = Pair(GEMMA3, 4, 80)
    assert [pair.step(seq, n, n) for seq, n in enumerate([33, 9, 9])] == [True, True, False]
    assert pair.step(0, 1) and pair.step(2, 9, 9)


@pytest.mark.parametrize("name", ["gemma-3-1b", "gemma-2-2b", "mistral-7b-v0.1"])
@against_vllm
def test_model_shapes_equal_vllms(name):
    """The published windows (512 and 4,096 tokens), blocks of 32, prompts past the window."""
    arch = ModelConfig.load(name)
    windows = tuple(arch.window(i) for i in range(arch.num_hidden_layers))
    over = max(w or 0 for w in windows) + 45
    pair = Pair(windows, 32, 2000 if over < 1000 else 4000)
    serve(pair, [over, 100], 40, chunk=2048)
