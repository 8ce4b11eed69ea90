"""Chapter 02's caches that are not K and V per head, worked through on published shapes
(data/models/): what a latent attention layer keeps per token against the multi-head attention
it compresses (DeepSeek-V2-Lite, DeepSeek-V3, and Kimi K2's heads on DeepSeek-V3's layers), the
attention block vLLM sets for a hybrid and what padding its states costs (Granite 4.0-H,
Nemotron-H, Qwen3-Next, Qwen3.5), and vLLM #40691, where Qwen3.5-27B's start-up line gave a
KV cache size and a concurrency that did not agree. All arithmetic is `kit.engine.kv_cache`'s.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from kit.config import DTYPE_BYTES, ModelConfig, reference
from kit.engine.hybrid_cache import KERNEL_BLOCK
from kit.engine.kv_cache import KVCacheLayout
from kit.engine.kv_specs import AttentionSpec, MambaSpec
from kit.units import Bytes, Count, Ratio

LATENT_MODELS = ("deepseek-v2-lite", "deepseek-v3")
HYBRID_MODELS = ("granite-4.0-h-small", "nemotron-h-8b", "qwen3-next-80b-a3b", "qwen3.5-27b",
                 "qwen3.5-35b-a3b")


def latent_models() -> list[ModelConfig]:
    """The latent attention shapes: the two DeepSeeks, and Kimi K2 (DeepSeek-V3's layers and
    latent with 64 heads instead of 128: its published config.json differs in heads, experts
    and vocabulary, none of which the cache sees but the heads)."""
    v3 = ModelConfig.load("deepseek-v3")
    kimi = replace(v3, name="Kimi K2 (DeepSeek-V3's layers, 64 heads)",
                   num_attention_heads=64, num_key_value_heads=64)
    return [*map(ModelConfig.load, LATENT_MODELS), kimi]


def latent_row(arch: ModelConfig, dtype: str = "bfloat16") -> dict:
    """Bytes a token keeps in one layer: the latent, and the keys and values multi-head
    attention would keep for the same heads (K: qk_nope + qk_rope per head, V: v_head_dim)."""
    b = DTYPE_BYTES[dtype]
    latent = arch.latent_size * b
    mha = arch.num_attention_heads * (arch.qk_nope_head_dim + arch.qk_rope_head_dim
                                      + arch.v_head_dim) * b
    return {"model": arch.name, "layers": Count(arch.num_hidden_layers),
            "heads": Count(arch.num_attention_heads),
            "latent_bytes_per_token_layer": Bytes(latent),
            "mha_bytes_per_token_layer": Bytes(mha), "mha_over_latent": Ratio(mha / latent),
            "latent_bytes_per_token": Bytes(latent * arch.num_hidden_layers)}


@dataclass(frozen=True)
class HybridBlock:
    """A hybrid's cache as vLLM lays it out: the numbers behind its block and padding."""

    model: str
    device: str
    layout: KVCacheLayout

    @property
    def attention(self) -> AttentionSpec:
        return next(g.spec for g in self.layout.groups if isinstance(g.spec, AttentionSpec))

    @property
    def state(self) -> MambaSpec:
        return next(g.spec for g in self.layout.groups if isinstance(g.spec, MambaSpec))

    @property
    def padding(self) -> float:
        """What the padding adds to a state, as vLLM's log line says it."""
        return self.state.page_size_bytes / self.state.state_bytes - 1

    def derivation(self) -> str:
        """vLLM's rule with this model's numbers (`kit.engine.hybrid_cache.align_hybrid`):
        block = k × ⌈state bytes / (k × attention bytes per token)⌉, k the larger of the
        kernel's block and block_size."""
        a, s = self.attention, self.state
        k = max(KERNEL_BLOCK[self.device], self.layout.requested_block_size)
        return f"{k} × ⌈{s.state_bytes:,} / ({k} × {a.bytes_per_token:,})⌉ = {a.block_size:,}"

    def log_lines(self) -> str:
        """The lines vLLM logs as it sets this block, led by the model they are about."""
        return "\n".join([f"vLLM's log for {self.model} on {self.device}:",
                          *(f"  {line}" for line in self.layout.notes)])

    def row(self, max_model_len: int, in_flight: int) -> dict:
        per_request = self.layout.blocks_per_request(max_model_len, in_flight)
        return {"model": self.model, "device": self.device,
                "attention_bytes_per_token": Bytes(self.attention.bytes_per_token),
                "state_bytes": Bytes(self.state.state_bytes),
                "block_size": Count(self.layout.block_size),
                "padding": Ratio(self.padding), "groups": Count(len(self.layout.groups)),
                "layers_per_group": Count(self.layout.group_size),
                "blocks_per_request": Count(per_request)}


def hybrid_block(name: str, device: str, block_size: int = 16, dtype: str = "bfloat16",
                 prefix_caching: bool = True) -> HybridBlock:
    arch = ModelConfig.load(name)
    return HybridBlock(name, device, KVCacheLayout.for_model(
        arch, block_size, dtype, device=device, prefix_caching=prefix_caching))


@dataclass(frozen=True)
class Issue40691:
    """vLLM #40691 (vLLM 0.19, Qwen3.5-27B, max_model_len 32,768): its start-up line said
    290,864 tokens and 33.04x, which disagree by 3.7x. The kit's layout of Qwen3.5-27B on a GPU
    (block 16 asked, prefix caching off: one state per request in each delta-net group) gives
    the block, the groups and the blocks a request reserves; the one num_blocks that gives
    both logged numbers follows, and with it what each formula counted."""

    layout: KVCacheLayout
    reported: dict
    num_blocks: int

    @property
    def per_request(self) -> int:
        return self.layout.blocks_per_request(self.reported["max_model_len"], 0)

    @property
    def old_tokens(self) -> int:
        """vLLM 0.19's line: num_blocks split evenly over the groups × the smallest block
        (the attention group's: a state group's block is max_model_len)."""
        return self.num_blocks // len(self.layout.groups) * self.layout.block_size

    @property
    def concurrency(self) -> float:
        return self.num_blocks / self.per_request

    @property
    def new_tokens(self) -> int:
        """vLLM 0.32's line (PR #40694): concurrency × max_model_len."""
        return int(self.concurrency * self.reported["max_model_len"])

    def summary(self) -> dict:
        return {"block_size": Count(self.layout.block_size),
                "groups": Count(len(self.layout.groups)), "num_blocks": Count(self.num_blocks),
                "blocks_per_request": Count(self.per_request),
                "old_line_tokens": Count(self.old_tokens), "concurrency": Ratio(self.concurrency),
                "new_line_tokens": Count(self.new_tokens),
                "kv_cache_bytes": Bytes(self.num_blocks * self.layout.bytes_per_block)}


def issue_40691() -> Issue40691:
    """The worked example: the num_blocks whose concurrency prints as the logged one and whose
    old formula gives the logged tokens (None found would mean the kit's layout is not the
    one vLLM ran)."""
    ref = reference("vllm40691")
    layout = KVCacheLayout.for_model(ModelConfig.load(ref["model"]), ref["block_size"],
                                     "bfloat16", device="cuda", prefix_caching=False)
    per_request = layout.blocks_per_request(ref["max_model_len"], 0)
    groups, logged = len(layout.groups), float(ref["log_concurrency"])
    candidates = range(math.floor((logged - 0.01) * per_request),
                       math.ceil((logged + 0.01) * per_request) + 1)
    found = [n for n in candidates if f"{n / per_request:.2f}" == ref["log_concurrency"]
             and n // groups * layout.block_size == ref["log_tokens"]]
    return Issue40691(layout, ref, found[0] if found else -1)
