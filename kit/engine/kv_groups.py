"""KV cache groups (chapter 02): how vLLM 0.32 shares one cache among layers whose specs differ
(`kit.engine.kv_specs`). No torch here.

When every layer's spec is the same there is one group of all layers. Otherwise vLLM buckets the
layers by spec, picks a group size (the smallest bucket's layer count, or the largest's when
the buckets are within 1.5× of each other) and splits every bucket into groups of at most that
many layers, group i of a bucket taking every n-th layer from the i-th
(vllm/v1/core/kv_cache_utils.py, `_get_kv_cache_groups_uniform_page_size`).

All groups draw block ids from one pool, and the cache is `group size` tensors of
num_blocks × page each, every tensor shared by one layer of each group: a block id is owned
by one group at a time, and one block id costs group size × page bytes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from kit.config import CHUNKED, FULL, SLIDING
from kit.engine.kv_specs import KVCacheSpec

SIMILAR_BUCKETS = 1.5  # buckets within this ratio make one group size of the largest


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers whose caches share block ids, and the spec they share (vLLM's
    `KVCacheGroupSpec`)."""

    layers: tuple[int, ...]
    spec: KVCacheSpec

    @property
    def window(self) -> int | None:
        """The layers' sliding window; None for full attention."""
        return self.spec.sliding_window

    @property
    def chunk(self) -> int | None:
        """The layers' attention chunk (Llama 4's chunked local layers); None: not chunked."""
        return getattr(self.spec, "attention_chunk_size", None)

    @property
    def kind(self) -> str:
        return CHUNKED if self.chunk else FULL if self.window is None else SLIDING

    def blocks_per_request(self, max_model_len: int, in_flight_tokens: int) -> int:
        """The blocks vLLM reserves in this group for one request of max_model_len tokens."""
        return self.spec.blocks_per_request(max_model_len, in_flight_tokens)

    def describe(self) -> str:
        return f"{self.spec.describe()}: layers {', '.join(map(str, self.layers))}"


def kv_cache_groups(specs: tuple[KVCacheSpec, ...],
                    layers: tuple[int, ...] | None = None) -> tuple[KVCacheGroup, ...]:
    """vLLM's KV cache groups for layers with these specs (one per layer, in order; `layers`:
    their indices where some layers have no spec, as Gemma 4's KV-shared layers)."""
    layers = tuple(range(len(specs))) if layers is None else tuple(layers)
    buckets: dict = {}
    for layer, spec in zip(layers, specs):
        buckets.setdefault(spec, []).append(layer)
    if len(buckets) == 1:
        return (KVCacheGroup(layers, specs[0]),)
    sizes = [len(layers) for layers in buckets.values()]
    size = max(sizes) if max(sizes) < min(sizes) * SIMILAR_BUCKETS else min(sizes)
    groups = []
    for spec, layers in buckets.items():
        n = math.ceil(len(layers) / size)
        groups += [KVCacheGroup(tuple(layers[i::n]), spec) for i in range(n)]
    return tuple(groups)
