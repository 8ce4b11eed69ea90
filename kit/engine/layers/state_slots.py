"""Where a recurrent layer (Mamba-2, a gated delta-net) keeps each request's state during a
paged run (chapters 04, 05): a slot per sequence, read and written in place.

A recurrent layer's state is fixed in size whatever the sequence's length: a convolution state
[conv_dim, conv_kernel - 1] (the last inputs its causal convolution still needs) and an SSM
state [heads, head_dim, d_state]. vLLM keeps it in one block of the layer's KV cache group
(`MambaSpec`: a request holds one such block without prefix caching, mamba_cache_mode "none"),
and its kernels find it through that group's block table, column 0 (`state_indices_tensor` in
vllm/v1/attention/backends/mamba2_attn.py). The kit does the same bookkeeping (the block
manager gives a recurrent group one block per sequence: `MambaSpec.blocks_for_tokens`), so a
state's slot is that block's id; the state's tensors live beside the paged KV cache, not inside
its pages (vLLM views the same bytes both ways, in the layer's dtypes; the kit's cache tensor
is one dtype), with a row per block id and, as the cache, one tensor per place in the widest
group (a block id belongs to one group at a time, so layers sharing a place never meet):

    conv [places, num_blocks, conv_dim, conv_kernel - 1]      (dtypes: `MambaSpec.dtypes`)
    ssm  [places, num_blocks, heads, head_dim, d_state]

Allocated once per batch (`allocate_states`) and handed to every forward inside
`AttentionMetadata.states`; a prefill starts each sequence from a zero state and writes its
final state to the slot (never reading it), a decode step reads and overwrites it in place, so
compiled code and CUDA graphs see the same tensors every step.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from kit.engine.kv_specs import MambaSpec

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class RecurrentStates(NamedTuple):
    """Every recurrent layer's states, one row per block id (a slot); see the module."""

    conv: torch.Tensor  # [places, num_blocks, conv_dim, conv_kernel - 1]
    ssm: torch.Tensor   # [places, num_blocks, heads, head_dim, d_state]


def state_group_spec(layout) -> MambaSpec | None:
    """The recurrent groups' spec (every recurrent layer's state is alike), or None."""
    return next((g.spec for g in layout.groups if isinstance(g.spec, MambaSpec)), None)


def allocate_states(layout, num_blocks: int, device) -> RecurrentStates | None:
    """Zeroed states for a cache of `num_blocks` blocks of `layout` (a
    `kit.engine.kv_cache.KVCacheLayout`), None for a layout without recurrent layers."""
    spec = state_group_spec(layout)
    if spec is None:
        return None
    places = layout.group_size
    (conv_shape, ssm_shape), (conv_dtype, ssm_dtype) = spec.shapes, spec.dtypes
    return RecurrentStates(
        torch.zeros((places, num_blocks, *conv_shape), dtype=DTYPES[conv_dtype], device=device),
        torch.zeros((places, num_blocks, *ssm_shape), dtype=DTYPES[ssm_dtype], device=device))


def state_slots(meta, group: int, block_size: int, num_seqs: int) -> torch.Tensor:
    """Each sequence's slot [num_seqs] (its block in recurrent group `group`): a decode step
    reads column 0 of the group's block table; a prefill, the slot of each sequence's first
    token (its `slot_mapping`, the sequences' tokens one after another)."""
    if meta.block_tables is not None:
        return meta.block_tables[group][:, 0]
    return meta.slot_mapping[group].view(num_seqs, -1)[:, 0] // block_size
