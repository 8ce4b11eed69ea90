"""A hybrid's KV cache as one buffer of pages (chapters 02, 04, 05): the attention layers'
keys and values and the recurrent layers' states live in the same bytes, each viewing them in
its own shape and dtype, so the cache a run allocates is exactly what sizing counts
(`KVCacheConfig.cache_bytes`: num_blocks × page × places).

vLLM 0.32 allocates every KV cache tensor in one int8 buffer (vllm/v1/worker/utils.py,
`allocate_kv_cache`) and gives each layer a view of it (vllm/v1/kv_cache_interface.py,
`create_kv_cache_views`): on the CPU layer-outer (`KVCacheLayout.LBHNC`, the layer's pages
one after another, block_stride = page), and a recurrent layer splits each block's page into
its states at byte offsets, conv first then ssm, each in its dtype
(vllm/model_executor/layers/mamba/abstract.py, `MambaBase.bind_kv_cache`); the rest of the
page is the padding that makes a state's page the attention page
(`kit.engine.hybrid_cache.align_hybrid`). The kit does the same, in one buffer with a row of
pages per place in the widest group (vLLM's `KVCacheTensor`s; a block id belongs to one group
at a time, so the layers sharing a place never meet):

    pages     [places, num_blocks, page bytes]                       uint8
    attention [places, num_blocks, 2, block_size, kv heads, head_dim] cache dtype, permuted to
              [places, 2, num_blocks, block_size, kv heads, head_dim]  (`tensor_shape`)
    conv      [places, num_blocks, conv_dim, conv_kernel - 1]         at byte 0 of a page
    ssm       [places, num_blocks, heads, head_dim, d_state]          after conv

Within a page the kit keeps all of K, then all of V ([2, block_size, heads, dim], as vLLM's
GPU runner laid a hybrid's attention out before 0.32: `_update_hybrid_attention_mamba_layout`),
where vLLM 0.32's CPU attention interleaves them per head and token ([heads, tokens, K|V]);
the bytes per page, and so every count, are the same. Bytes no token wrote (a block's unused
positions, which may hold the state of the block's last owner) are never used: attention
masks them, values included (`paged_decode_attention`'s zero_masked), and a recurrent layer
reads a slot only after its prefill wrote it. Models without states keep one contiguous
tensor (`kit.engine.kv_cache.allocate`).
"""
from __future__ import annotations

import math

import torch

from kit.engine.kv_specs import MambaSpec
from kit.measure.device import torch_dtype


def allocate_pages(layout, num_blocks: int, device, dtype: torch.dtype) -> torch.Tensor:
    """A zeroed buffer of `num_blocks` pages per place of `layout` (a
    `kit.engine.kv_cache.KVCacheLayout` with states), returned as its attention layers'
    view (`attention_view`); the states are views of the same bytes (`state_views`)."""
    pages = torch.zeros((layout.group_size, num_blocks, layout.page_size_bytes),
                        dtype=torch.uint8, device=device)
    return attention_view(pages, layout, dtype)


def attention_view(pages: torch.Tensor, layout, dtype: torch.dtype) -> torch.Tensor:
    """The attention layers' cache in `pages` [places, num_blocks, page bytes], shaped as
    `layout.tensor_shape` (K and V per head, or a latent) but block-major in memory: each
    block's tokens are the first bytes of its page."""
    places, num_blocks, page = pages.shape
    shape = layout.tensor_shape(num_blocks)
    latent = len(shape) == 4
    per_page = shape[2:] if latent else (2, *shape[3:])
    size = math.prod(per_page) * dtype.itemsize
    if size > page:
        raise ValueError(f"a block of attention takes {size:,} B, more than a page's {page:,}")
    blocks = pages[..., :size].view(dtype).unflatten(-1, per_page)
    return blocks if latent else blocks.permute(0, 2, 1, 3, 4, 5)


def pages_of(cache: torch.Tensor, layout) -> torch.Tensor:
    """The buffer of pages [places, num_blocks, page bytes] behind an attention view made by
    `allocate_pages` (the same storage, from its start)."""
    num_blocks = cache.shape[1] if cache.dim() == 4 else cache.shape[2]
    shape = (layout.group_size, num_blocks, layout.page_size_bytes)
    storage = cache.untyped_storage()
    pages = torch.empty(0, dtype=torch.uint8, device=cache.device)
    if storage.nbytes() == math.prod(shape):
        pages = pages.set_(storage).view(shape)
    if pages.dim() == 1 or attention_view(pages, layout, cache.dtype).stride() != cache.stride():
        raise ValueError(f"this cache is not a view of {shape} pages: a hybrid's cache must be "
                         "allocated by kit.engine.kv_cache.allocate, so its states live in "
                         "its pages")
    return pages


def state_views(pages: torch.Tensor, spec: MambaSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """(conv, ssm) in `pages` [places, num_blocks, page bytes]: each block's page holds one
    state, its conv bytes first, then its ssm bytes, each in its dtype (`spec.shapes`,
    `spec.dtypes`), as vLLM's `MambaBase.bind_kv_cache` views them.

    Each comes as a tensor of its own storage over those bytes (`torch.from_dlpack`, which
    keeps the pages alive): handed inputs that share a storage and are written, torch.compile
    (AOTAutograd's synthetic base) copies the whole buffer several times a step. It need not
    know: the bytes one forward touches through the attention view and through the states
    never overlap, since a block id belongs to one group at a time (vLLM's kernels, opaque
    to its compiler, rely on the same). Written through them, the states must be written
    whole-tensor (`kit.engine.layers.state_slots.write_state`)."""
    views, offset = [], 0
    for shape, name in zip(spec.shapes, spec.dtypes):
        dtype = torch_dtype(name)
        size = math.prod(shape) * dtype.itemsize
        if offset % dtype.itemsize:
            raise ValueError(f"a {name} state cannot start at byte {offset} of a page")
        view = pages[..., offset:offset + size].view(dtype).unflatten(-1, shape)
        views.append(torch.from_dlpack(view))
        offset += size
    if offset > pages.shape[-1]:
        raise ValueError(f"a state of {offset:,} B does not fit a page of {pages.shape[-1]:,} B")
    return tuple(views)
