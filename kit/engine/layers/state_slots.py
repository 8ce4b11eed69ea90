"""Where a recurrent layer (Mamba-2, a gated delta-net) keeps each request's state during a
paged run (chapters 04, 05): a slot per sequence, read and written in place.

A recurrent layer's state is fixed in size whatever the sequence's length: a convolution state
[conv_dim, conv_kernel - 1] (the last inputs its causal convolution still needs) and an SSM
state [heads, head_dim, d_state]. vLLM keeps it in one block of the layer's KV cache group
(`MambaSpec`: a request holds one such block without prefix caching, mamba_cache_mode "none"),
and its kernels find it through that group's block table, column 0 (`state_indices_tensor` in
vllm/v1/attention/backends/mamba2_attn.py). The kit does the same bookkeeping (the block
manager gives a recurrent group one block per sequence: `MambaSpec.blocks_for_tokens`), so a
state's slot is that block's id, and the state lives inside that block's page of the paged KV
cache, as in vLLM: the cache is one buffer of pages (`kit.engine.hybrid_pages`), viewed by the
attention layers as keys and values and by the recurrent layers, at byte offsets within each
page, as their states in their own dtypes (conv first, then ssm; the rest is padding), with a
row per block id and, as the cache's, a row of pages per place in the widest group (a block id
belongs to one group at a time, so layers sharing a place never meet):

    conv [places, num_blocks, conv_dim, conv_kernel - 1]      (dtypes: `MambaSpec.dtypes`)
    ssm  [places, num_blocks, heads, head_dim, d_state]       (strided: a page apart per block)

Viewed once per batch (`allocate_states`, from the cache `kit.engine.kv_cache.allocate` made)
and handed to every forward inside `AttentionMetadata.states`; a prefill starts each sequence
from a zero state and writes its final state to the slot (never reading it), a decode step
reads and overwrites it in place, so compiled code and CUDA graphs see the same tensors every
step. The cache's measured memory is the states' too.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from kit.engine.hybrid_pages import pages_of, state_views
from kit.engine.kv_specs import MambaSpec


class RecurrentStates(NamedTuple):
    """Every recurrent layer's states, one row per block id (a slot); see the module."""

    conv: torch.Tensor  # [places, num_blocks, conv_dim, conv_kernel - 1]
    ssm: torch.Tensor   # [places, num_blocks, heads, head_dim, d_state]


def state_group_spec(layout) -> MambaSpec | None:
    """The recurrent groups' spec (every recurrent layer's state is alike), or None."""
    return next((g.spec for g in layout.groups if isinstance(g.spec, MambaSpec)), None)


def allocate_states(layout, kv_cache: torch.Tensor) -> RecurrentStates | None:
    """The states inside the pages of `kv_cache` (made for `layout`, a
    `kit.engine.kv_cache.KVCacheLayout`, by `kit.engine.kv_cache.allocate`), None for a
    layout without recurrent layers."""
    spec = state_group_spec(layout)
    if spec is None:
        return None
    return RecurrentStates(*state_views(pages_of(kv_cache, layout), spec))


def state_slots(meta, group: int, block_size: int, num_seqs: int) -> torch.Tensor:
    """Each sequence's slot [num_seqs] (its block in recurrent group `group`): a decode step
    reads column 0 of the group's block table; a prefill, the slot of each sequence's first
    token (its `slot_mapping`, the sequences' tokens one after another)."""
    if meta.block_tables is not None:
        return meta.block_tables[group][:, 0]
    return meta.slot_mapping[group].view(num_seqs, -1)[:, 0] // block_size


def write_state(states: torch.Tensor, place: int, slots: torch.Tensor,
                value: torch.Tensor) -> None:
    """Store `value` [seqs, ...] at `slots` of place `place` of one of the states' tensors
    (`RecurrentStates.conv` or `.ssm`), in its dtype.

    One `index_put_` on the whole tensor, indexed by (place, slot): compiled, an in-place
    scatter of just these rows. Written through a view (`states[place].index_copy_`),
    Inductor copied the states of every block out and back in on every call (it rewrites
    such a write in place only for dense tensors; the states are strided views of the pages),
    and the copy back overwrote keys and values the attention layers had written meanwhile."""
    states.index_put_((torch.full_like(slots, place), slots), value.to(states.dtype))
