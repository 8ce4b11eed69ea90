"""A hybrid's KV cache is one buffer of pages (kit.engine.hybrid_pages): what a run allocates is
exactly what sizing counts, the recurrent states are views of their blocks' pages, and a write
to a block's page, state or keys and values, stays in that page. No model, no vLLM: quick."""
import json

import pytest
import torch

from kit.config import MODELS_DIR, ModelConfig
from kit.engine.decode import batch_for_run, generate, make_prompts
from kit.engine.hybrid_pages import pages_of
from kit.engine.kv_cache import (KVCacheLayout, allocate, allocate_measured, kv_cache_config,
                                 layer_views)
from kit.engine.layers.attention import write_kv
from kit.engine.layers.state_slots import allocate_states, state_group_spec, write_state
from kit.engine.model import build_model


def two_places() -> KVCacheLayout:
    """tiny-mamba with six layers, two of them attention: groups of two layers (two Mamba
    groups and an attention group), so the pages have two places."""
    config = json.loads((MODELS_DIR / "tiny-mamba.json").read_text())
    config.update(num_hidden_layers=6,
                  layer_types=["mamba", "attention", "mamba", "mamba", "attention", "mamba"])
    layout = KVCacheLayout.for_model(ModelConfig.from_dict(config, "two-places"), 16,
                                     "bfloat16", device="cpu")
    assert layout.group_size == 2 and len(layout.groups) == 3
    return layout


@pytest.mark.parametrize("device", ["cpu", "cuda"])  # the layout vLLM gives each (allocated here)
@pytest.mark.parametrize("model", ["tiny-mamba", "tiny-gdn"])
def test_the_measured_allocation_is_the_sized_cache(model, device):
    """num_blocks × page × places bytes, states and all: the attention view and both states
    lie in the one allocation."""
    layout = KVCacheLayout.for_model(ModelConfig.load(model), 16, "bfloat16", device=device)
    config = kv_cache_config(layout, 50 * layout.bytes_per_block + 123, 64)
    cache, allocated = allocate_measured(layout, config.num_blocks, "cpu")
    states = allocate_states(layout, cache)
    assert config.num_blocks == 50
    assert allocated == config.cache_bytes == 50 * layout.page_size_bytes * layout.group_size
    start = cache.untyped_storage().data_ptr()
    for view in (cache, states.conv, states.ssm):
        last = view.data_ptr() + sum((n - 1) * s for n, s in zip(view.shape, view.stride())) \
            * view.element_size()
        assert start <= view.data_ptr() and last < start + allocated
    spec = state_group_spec(layout)
    assert (states.conv.dtype, states.ssm.dtype) == tuple(getattr(torch, d) for d in spec.dtypes)
    assert (states.conv.shape[2:], states.ssm.shape[2:]) == spec.shapes


def test_every_view_starts_where_its_page_says():
    """Block b of place p: its keys at the page's first byte and its values half a page of
    attention on; its conv state at the first byte too, its ssm state right after conv."""
    layout = two_places()
    cache = allocate(layout, 7, "cpu")
    pages, states = pages_of(cache, layout), allocate_states(layout, cache)
    conv_bytes = states.conv[0, 0].numel() * states.conv.element_size()
    half = cache[0, 0, 0].numel() * cache.element_size()
    for p in range(2):
        for b in range(7):
            page = pages[p, b].data_ptr()
            assert cache[p, 0, b].data_ptr() == page and cache[p, 1, b].data_ptr() == page + half
            assert states.conv[p, b].data_ptr() == page
            assert states.ssm[p, b].data_ptr() == page + conv_bytes
    assert 2 * half == layout.page_size_bytes  # the attention page is the page, states padded


def test_a_write_stays_in_its_blocks_page():
    """Writing one slot's state changes that block's page and no other (its keys' bytes
    included: a block id belongs to one group at a time); writing one token's keys and values
    changes its block's page alone, and no slot's state elsewhere."""
    layout = two_places()
    cache = allocate(layout, 7, "cpu")
    pages, states = pages_of(cache, layout), allocate_states(layout, cache)
    pages.copy_(torch.randint(0, 256, pages.shape, generator=torch.Generator().manual_seed(0)))
    before = pages.clone()
    slots = torch.tensor([4])
    write_state(states.conv, 1, slots, torch.ones(1, *states.conv.shape[2:]))
    write_state(states.ssm, 1, slots, torch.full((1, *states.ssm.shape[2:]), 2.0))
    changed = (pages != before).any(-1)
    assert changed.nonzero().tolist() == [[1, 4]]
    assert (states.conv[1, 4] == 1).all() and (states.ssm[1, 4] == 2).all()
    assert not torch.equal(cache[1, 0, 4].view(torch.uint8), before[1, 4, :half_page(cache)])

    before = pages.clone()
    k = torch.randn(1, *cache.shape[-2:]).to(cache.dtype)
    write_kv(cache, 0, k, -k, torch.tensor([2 * layout.block_size + 3]))  # block 2, offset 3
    assert (pages != before).any(-1).nonzero().tolist() == [[0, 2]]
    assert torch.equal(layer_views(cache, layout)[1][0, 2, 3], k[0])
    assert torch.equal(cache[0, 1, 2, 3], -k[0])


def half_page(cache) -> int:
    return cache[0, 0, 0].numel() * cache.element_size()


def test_only_a_cache_of_pages_holds_states():
    """A hybrid's cache made otherwise (one contiguous tensor of its shape) is refused by
    name; a model without states keeps its one contiguous tensor, as before."""
    layout = two_places()
    plain = torch.zeros(layout.tensor_shape(7), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="kit.engine.kv_cache.allocate"):
        allocate_states(layout, plain)
    dense = KVCacheLayout.for_model(ModelConfig.load("tiny"), 16, "bfloat16")
    cache = allocate(dense, 7, "cpu")
    assert cache.is_contiguous() and tuple(cache.shape) == dense.tensor_shape(7)
    assert allocate_states(dense, cache) is None


def test_bytes_no_token_wrote_do_not_reach_the_logits():
    """A decode on pages that start as NaN (what a state's bytes may be, read as keys and
    values, where a block held a state before) gives the logits of a decode on zeroed pages:
    attention masks those positions' values as well as their scores, and a prefill writes
    the states it later reads."""
    arch = ModelConfig.load("tiny-mamba")
    model = build_model(arch, "float32", "cpu")
    layout = KVCacheLayout.for_model(arch, 16, "float32", device="cpu")
    prompts = make_prompts([5, 9], arch.vocab_size)
    runs = []
    for byte in (0, 0xFF):  # 0xFF...: NaN in any float dtype
        batch = batch_for_run(layout, [5, 9], 3, "cpu")
        pages_of(batch.kv_cache, layout).fill_(byte)
        runs.append(generate(model, batch, prompts, 3).logits)
    assert runs[0].isfinite().all() and torch.equal(runs[0], runs[1])
