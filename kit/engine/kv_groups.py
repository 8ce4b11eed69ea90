"""KV cache groups (chapter 02): how vLLM 0.32 shares one cache among layers that attend
differently. No torch here.

Each attention layer has a cache spec: full attention, or a sliding window of W tokens. When
every layer's spec is the same there is one group of all layers. Otherwise vLLM buckets the
layers by spec, picks a group size (the smallest bucket's layer count, or the largest's when
the buckets are within 1.5× of each other) and splits every bucket into groups of at most that
many layers, group i of a bucket taking every n-th layer from the i-th
(vllm/v1/core/kv_cache_utils.py, `_get_kv_cache_groups_uniform_page_size`).

All groups draw block ids from one pool, and the cache is `group size` tensors of
num_blocks × page each, every tensor shared by one layer of each group: a block id is owned
by one group at a time, and one block id costs group size × page bytes.

A request reserves, per group, the blocks its longest context needs: ceil(max_model_len / block)
for full attention; for a window W, the tokens a step can still attend to plus the ones it
writes, min(W − 1 + max_num_batched_tokens, max_model_len), in blocks, plus one block for a
window that straddles a block boundary (`SlidingWindowSpec.max_memory_usage_bytes`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from kit.config import FULL, SLIDING

SIMILAR_BUCKETS = 1.5  # buckets within this ratio make one group size of the largest


@dataclass(frozen=True)
class KVGroup:
    """Layers whose caches share block ids; `window` is None for full attention."""

    layers: tuple[int, ...]
    window: int | None = None

    @property
    def kind(self) -> str:
        return FULL if self.window is None else SLIDING

    def blocks_per_request(self, max_model_len: int, block_size: int,
                           max_num_batched_tokens: int) -> int:
        """The blocks vLLM reserves in this group for one request of max_model_len tokens."""
        if self.window is None:
            return math.ceil(max_model_len / block_size)
        tokens = min(self.window - 1 + max_num_batched_tokens, max_model_len)
        return math.ceil(tokens / block_size) + 1

    def describe(self) -> str:
        what = "full attention" if self.window is None else f"window {self.window:,}"
        return f"{what}: layers {', '.join(map(str, self.layers))}"


def kv_groups(windows: tuple) -> tuple[KVGroup, ...]:
    """vLLM's KV cache groups for layers with these windows (None: full attention)."""
    buckets: dict = {}
    for layer, window in enumerate(windows):
        buckets.setdefault(window, []).append(layer)
    if len(buckets) == 1:
        return (KVGroup(tuple(range(len(windows))), windows[0]),)
    sizes = [len(layers) for layers in buckets.values()]
    size = max(sizes) if max(sizes) < min(sizes) * SIMILAR_BUCKETS else min(sizes)
    groups = []
    for window, layers in buckets.items():
        n = math.ceil(len(layers) / size)
        groups += [KVGroup(tuple(layers[i::n]), window) for i in range(n)]
    return tuple(groups)


def layer_windows(arch) -> tuple:
    """Each layer's sliding window (None: full attention), or () when no layer slides."""
    windows = tuple(arch.window(i) for i in range(arch.num_hidden_layers))
    return windows if any(windows) else ()


def model_groups(arch) -> tuple[KVGroup, ...]:
    """`arch`'s KV cache groups: one of every layer when none slides."""
    return kv_groups(layer_windows(arch) or (None,) * arch.num_hidden_layers)


def cache_place(groups: tuple[KVGroup, ...], layer: int) -> tuple[int, int]:
    """(`layer`'s group, its place in the group): the block table it reads, and the slice of a
    cache laid out as vLLM's (`kv_cache.allocate_shared`) that holds its pages."""
    group = next(i for i, g in enumerate(groups) if layer in g.layers)
    return group, groups[group].layers.index(layer)


def with_layer_pattern(arch, full_every: int | None,
                       sliding_window: int | None = None):
    """`arch` with every `full_every`-th layer full attention and the others sliding over
    `sliding_window` tokens (its own window when None); `full_every` 0 keeps its layers."""
    if full_every == 0:
        return arch
    window = sliding_window or arch.sliding_window or 4096
    kinds = tuple(FULL if full_every and (i + 1) % full_every == 0 else SLIDING
                  for i in range(arch.num_hidden_layers))
    if SLIDING not in kinds:
        return replace(arch, layer_types=(), sliding_window=None)
    return replace(arch, layer_types=kinds, sliding_window=window)


def group_size(groups: tuple[KVGroup, ...]) -> int:
    """Layers in the widest group: the number of cache tensors, and pages per block id."""
    return max(len(g.layers) for g in groups)
