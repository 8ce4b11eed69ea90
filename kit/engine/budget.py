"""The memory budget (chapters 01-04), in one place: what the engine may use, capacity ×
gpu_memory_utilization (vLLM's requested memory), and what is left of it for the KV cache once
the weights, the profiling run's peak activations and non-torch memory are counted. No torch.

    KV cache bytes = capacity × gpu_memory_utilization − weights − peak activations
                     − non-torch memory

`kv_cache_memory_bytes`, when given, overrides all of it, as vLLM's option of that name does
(`kv_budget`).
"""
from __future__ import annotations

from dataclasses import dataclass

from kit.config import DTYPE_BYTES
from kit.errors import ConfigError


def requested_memory(capacity_bytes: int, gpu_memory_utilization: float) -> int:
    """The memory the engine may use: capacity × gpu_memory_utilization, which weights,
    activations and the KV cache share."""
    return int(capacity_bytes * gpu_memory_utilization)


@dataclass(frozen=True)
class MemoryBudget:
    """How one rank's memory splits: weights, activations, non-torch memory, the KV cache, and
    what gpu_memory_utilization holds back."""

    capacity_bytes: int
    gpu_memory_utilization: float
    weights_bytes: int
    activation_bytes: int = 0
    non_torch_bytes: int = 0

    @property
    def budget_bytes(self) -> int:
        return requested_memory(self.capacity_bytes, self.gpu_memory_utilization)

    @property
    def reserved_bytes(self) -> int:
        return self.capacity_bytes - self.budget_bytes

    @property
    def non_kv_cache_bytes(self) -> int:
        return self.weights_bytes + self.activation_bytes + self.non_torch_bytes

    @property
    def kv_cache_bytes(self) -> int:
        """What is left for the KV cache (negative when nothing is)."""
        return self.budget_bytes - self.non_kv_cache_bytes


def weights_budget(arch, model_dtype: str, capacity_bytes: int, gpu_memory_utilization: float,
                   tensor_parallel_size: int = 1, activation_bytes: int = 0) -> MemoryBudget:
    """The budget before any weights are loaded: the weights counted from the shapes (split
    evenly over the ranks: vLLM shards the linear layers and the embedding; the small norms
    are replicated), with `activation_bytes` when known."""
    weights = arch.num_parameters() * DTYPE_BYTES[model_dtype] // tensor_parallel_size
    return MemoryBudget(capacity_bytes, gpu_memory_utilization, weights, activation_bytes)


def kv_budget(settings, profile: str, profile_kv_cache_bytes: int | None) -> tuple[int, str]:
    """The KV budget and where it came from: `kv_cache_memory_bytes` when given (it overrides
    any profile, as vLLM's option of that name does), else what the memory profile named
    `profile` ("eager" or "compiled", chapter 01) left for the cache."""
    if settings.kv_cache_memory_bytes is not None:
        return settings.kv_cache_memory_bytes, "kv_cache_memory_bytes"
    if profile_kv_cache_bytes is None:
        raise ConfigError("no KV budget: give kv_cache_memory_bytes or a memory profile")
    return profile_kv_cache_bytes, f"the {profile} memory profile"


def estimate_activation_bytes(arch, num_tokens: int, num_seqs: int, dtype_bytes: int) -> int:
    """A rough eager peak for models the kit has not profiled: one layer's largest live set
    (residual and normed input, the MLP's gate, up and activated tensors) for every token, plus
    the logits of one token per sequence (model dtype and an fp32 copy for sampling)."""
    per_token = (2 * arch.hidden_size + 3 * arch.intermediate_size) * dtype_bytes
    return num_tokens * per_token + num_seqs * arch.vocab_size * (dtype_bytes + 4)
