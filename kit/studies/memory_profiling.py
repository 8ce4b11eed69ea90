"""Chapter 01, memory profiling as vLLM does it (`kit.engine.profile_run`: the profile run,
eager and compiled): what each profile leaves the KV cache, in blocks, and the compiled
profile against the eager one beside the numbers of vLLM #7796.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from kit.config import DTYPE_BYTES, ModelConfig, reference
from kit.engine.budget import mlp_floor_bytes
from kit.engine.kv_cache import KVCacheLayout
from kit.engine.profile_run import MemoryProfile, profile_memory
from kit.units import Bytes, Count, Fraction, Ratio, parse_bytes


def blocks_left(layout: KVCacheLayout, profiles: dict[str, "MemoryProfile"]) -> dict:
    """The KV cache each profile leaves, in blocks of the run's cache (`layout`; chapter 02's
    unit: vLLM's num_gpu_blocks); none when a profile leaves nothing."""
    per_block = layout.bytes_per_block
    return {**{name: Count(max(0, p.kv_cache_bytes) // per_block)
               for name, p in profiles.items()},
            "block_size": Count(layout.block_size), "bytes_per_block": Bytes(per_block)}


@dataclass
class VersusPR:
    """The compiled profile against the eager one, as ratios, beside the PR's.

    What the compiled profile gains is the eager profile's extra activations, so
    KV compiled ÷ KV eager = 1 + extra ÷ KV eager: the lesson shows on a device as tight as the
    PR's, where the eager profile's extra activations are a sizeable share of the cache it
    leaves (the PR: 8800 of 25752 blocks), and vanishes on a roomy one."""

    kv_ratio: float             # KV cache bytes, compiled ÷ eager
    activation_ratio: float     # peak activations, compiled ÷ eager
    pr_kv_ratio: float          # the PR's KV blocks, compiled ÷ eager (Gemma-2B on a GPU)
    pr_blocks: tuple[int, int]  # the PR's (compiled, eager) blocks
    extra_bytes: int            # the eager peak's activations beyond the compiled one's
    eager_kv_bytes: int         # what the eager profile leaves the KV cache
    weights_share: float        # weights ÷ the device's capacity, here
    pr_weights_share: float     # Gemma-2B's bf16 weights ÷ the 16 GiB its numbers fit

    @property
    def extra_over_eager_kv(self) -> float:
        return self.extra_bytes / self.eager_kv_bytes

    @property
    def pr_extra_over_eager_kv(self) -> float:
        compiled, eager = self.pr_blocks
        return (compiled - eager) / eager

    def summary(self) -> dict:
        return {**Ratio.of({"kv_ratio_compiled_over_eager": self.kv_ratio,
                            "activation_ratio_compiled_over_eager": self.activation_ratio,
                            "pr_kv_ratio": self.pr_kv_ratio,
                            "eager_extra_over_eager_kv": self.extra_over_eager_kv,
                            "pr_eager_extra_over_eager_kv": self.pr_extra_over_eager_kv}),
                "eager_extra_activation_bytes": Bytes(self.extra_bytes),
                **Fraction.of({"weights_share_of_capacity": self.weights_share,
                               "pr_weights_share_of_capacity": self.pr_weights_share})}


def versus_pr(profiles: dict[str, MemoryProfile]) -> VersusPR:
    pr = reference("pr7796")
    eager, compiled = profiles["eager"], profiles["compiled"]
    blocks = (pr["kv_blocks_profile_compiled"], pr["kv_blocks_profile_eager"])
    return VersusPR(compiled.kv_cache_bytes / eager.kv_cache_bytes,
                      compiled.peak_activation_bytes / eager.peak_activation_bytes,
                      blocks[0] / blocks[1], blocks,
                      eager.peak_activation_bytes - compiled.peak_activation_bytes,
                      eager.kv_cache_bytes, eager.weights_bytes / eager.capacity_bytes,
                      ModelConfig.load(pr["model"]).num_parameters() * 2
                      / parse_bytes(pr["device_memory_assumed"]))


# --- the profile run through experts ---------------------------------------------------------

# The chapter's mixture of experts and the dense model of the same active size: tiny-moe is
# tiny's shape with 16 experts, 4 per token, each a quarter of tiny's MLP.
EXPERTS_PAIR = ("tiny-moe", "tiny")
# Models whose weights the chapter splits into experts and the rest.
WEIGHTS_MODELS = ("tiny", "tiny-moe", "qwen3-30b-a3b", "mixtral-8x7b", "llama-4-scout")


def weights_split(arch: ModelConfig, dtype: str) -> dict:
    """The weights with every expert resident (what the budget charges), how much of them is
    experts (`ModelConfig.experts_parameters`), and the share one token runs through."""
    total, experts = arch.num_parameters(), arch.experts_parameters()
    return {"model": arch.name, **Count.of({"parameters": total,
                                            "active_parameters": arch.active_parameters()}),
            **Bytes.of({"weights_bytes": total * DTYPE_BYTES[dtype],
                        "experts_bytes": experts * DTYPE_BYTES[dtype]}),
            **Fraction.of({"experts_share": experts / total,
                           "active_share": arch.active_parameters() / total})}


def one_layer(arch: ModelConfig) -> ModelConfig:
    """`arch` cut to its first layer: the profiling forward's peak is one layer's live set (a
    layer frees its intermediates before the next starts), at a quarter of tiny's compile."""
    return replace(arch, num_hidden_layers=1, layer_types=arch.layer_types[:1],
                   mlp_kinds=arch.mlp_kinds[:1])


def experts_profiles(settings, models=EXPERTS_PAIR) -> dict[str, dict[str, MemoryProfile]]:
    """Each model's first layer (`one_layer`) profiled eager and compiled at the settings'
    largest batch (`profile_memory`): the MoE routes its max_num_batched_tokens tokens through
    k experts each, the dense model runs them through its MLP."""
    out = {}
    for name in models:
        n = min(settings.max_model_len, ModelConfig.load(name).max_position_embeddings)
        s = replace(settings, model=name, max_model_len=n,  # the profile does not read these
                    input_len=min(settings.input_len, n // 2),
                    output_len=min(settings.output_len, n // 2))
        out[name] = profile_memory(s, arch=one_layer(s.arch))
    return out


def experts_summary(profiles: dict[str, dict[str, MemoryProfile]], dtype: str) -> dict:
    """Each model's peaks (eager, compiled), its one layer's measured weights and the least
    its MLP must hold (`mlp_floor_bytes`: the routed gate-and-up rows for the MoE)."""
    out = {}
    for name, by_profile in profiles.items():
        arch = one_layer(ModelConfig.load(name))
        tokens = by_profile["eager"].num_tokens
        out[name] = {**Bytes.of({f"{k}_peak_activation_bytes": p.peak_activation_bytes
                                 for k, p in by_profile.items()}),
                     **Bytes.of({"layer_weights_bytes": by_profile["eager"].weights_bytes,
                                 "layer_counted_weights_bytes":
                                     arch.num_parameters() * DTYPE_BYTES[dtype],
                                 "mlp_floor_bytes": mlp_floor_bytes(arch, tokens,
                                                                    DTYPE_BYTES[dtype])}),
                     "num_tokens": Count(tokens)}
    return out


def built_experts_parameters(arch: ModelConfig) -> int:
    """Elements of every `Experts` module of the kit's model for `arch`, built on the meta
    device (no memory, any size): what `ModelConfig.experts_parameters` counts from shapes."""
    import torch
    from kit.engine.layers.experts import Experts
    from kit.engine.model import Decoder
    with torch.device("meta"):
        model = Decoder(arch)
    return sum(p.numel() for m in model.modules() if isinstance(m, Experts)
               for p in m.parameters())
