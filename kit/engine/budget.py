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
from kit.config import cache_kinds_counts as sized
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
    are replicated), with `activation_bytes` when known. A mixture of experts keeps every
    expert resident, so `num_parameters` counts all of them, not the k a token runs; over
    tensor-parallel ranks vLLM's FusedMoE splits each expert's intermediate size (or, with
    expert parallelism, the experts themselves), so they too divide evenly. Only the routers
    are replicated, like the norms: E × hidden per MoE layer (12 MiB of Qwen3-30B-A3B's 57 GiB
    in bf16), left in the split."""
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


def mlp_live_elements(arch, layer: int) -> int:
    """Elements one token holds at the peak of layer `layer`'s MLP. Dense: the gate and up
    outputs and the activated product, 3 × intermediate_size. Experts: the token's k routed
    rows in vLLM's fused-experts workspace (`fused_experts_impl`), each a gate-and-up row of
    2 × moe_intermediate_size sharing its memory with the row's down output (hidden_size),
    beside its activated row (moe_intermediate_size). A family sized only: its own
    (`kit.config.cache_kinds_counts.mlp_peak_elements`)."""
    if arch.parts.sized_only:
        return sized.mlp_peak_elements(arch, layer)
    if not arch.is_moe(layer):
        return 3 * arch.layer_intermediate_size(layer)  # (Gemma 4 doubles some layers')
    i = arch.moe_intermediate_size
    routed = arch.num_experts_per_tok * (max(2 * i, arch.hidden_size) + i)
    return max(routed, 3 * arch.shared_expert_intermediate_size)  # Llama 4's runs apart


def mlp_floor_bytes(arch, num_tokens: int, dtype_bytes: int) -> int:
    """The least an MLP must hold for `num_tokens` tokens at once, whatever runs it: the
    dense intermediate (tokens × intermediate_size), or the routed gate-and-up rows (tokens ×
    k rows of 2 × moe_intermediate_size), the larger over the layers."""
    per_token = max(arch.num_experts_per_tok * 2 * arch.moe_intermediate_size
                    if arch.is_moe(i) else arch.layer_intermediate_size(i)
                    for i in range(arch.num_hidden_layers))
    return num_tokens * per_token * dtype_bytes


def estimate_activation_bytes(arch, num_tokens: int, num_seqs: int, dtype_bytes: int) -> int:
    """A rough eager peak for models the kit has not profiled: one layer's largest live set
    (residual and normed input, and the largest MLP's live elements, `mlp_live_elements`) for
    every token, plus the logits of one token per sequence (model dtype and an fp32 copy for
    sampling)."""
    mlp = max(mlp_live_elements(arch, i) for i in range(arch.num_hidden_layers))
    per_token = (2 * arch.hidden_size + mlp) * dtype_bytes
    return num_tokens * per_token + num_seqs * arch.vocab_size * (dtype_bytes + 4)
