"""The specs of caches that are not K and V per head (chapter 02), and vLLM 0.32's rules for
them: a latent attention layer's page, a recurrent layer's state, and a hybrid's block, which
vLLM enlarges until one attention page holds a whole state, padding the state's page to
match (`Platform._align_hybrid_block_size`, run once the model is loaded). No torch here but
the CPU's feature probes (`BackendTraits.for_device`).

    attention page per token  = 2 × KV heads × head_dim × cache dtype bytes (latent: 1 ×
                                (kv_lora_rank + qk_rope_head_dim) × bytes)
    state page                = conv state × conv dtype bytes + SSM state × SSM dtype bytes
    kernel                    = max(the backend's kernel block, block_size)
    attention block           = kernel × ceil(state page / (kernel × page per token)), then a
                                multiple of every attention backend's kernel block
    padding                   = attention block × page per token − state page
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import lru_cache

from kit.engine.kv_specs import AttentionSpec, KVCacheSpec, MambaSpec, MLAAttentionSpec

# The attention backends' kernel blocks (`get_supported_kernel_block_sizes`): vLLM's CPU
# attention takes multiples of 32 and its reference CPU latent attention blocks of 16 only;
# on CUDA, FlashAttention (vLLM's default on Hopper) multiples of 16.
KERNEL_BLOCK = {"cpu": 32, "cuda": 16}
CPU_MLA_BLOCK = 16
# vLLM's hybrid rule makes a latent attention's block a multiple of this (FlashMLA/TRTLLM)
MLA_HYBRID_ALIGNMENT = 128
# vLLM's log lines when it enlarges a hybrid's attention block and pads its states.
SETTING_BLOCK = ("Setting attention block size to {} tokens to ensure that attention page size "
                 "is >= mamba page size.")
PADDING_STATE = ("Padding mamba page size by {:.2f}% to ensure that mamba page size and "
                 "attention page size are exactly equal.")


@dataclass(frozen=True)
class BackendTraits:
    """What vLLM decides from the machine it runs on, for these caches: its CPU platform runs
    latent attention with AMX kernels at any block, or, without AMX, with its reference kernel
    at blocks of 16 only; and keeps recurrent states in float32 where the CPU has AVX-512 BF16
    (its accelerated gated delta-net kernels: `CpuPlatform.check_and_update_config`)."""

    device: str
    kernel_block: int
    mla_block: int | None = None    # None: the block asked
    ssm_float32: bool = False

    @classmethod
    def for_device(cls, device: str | None) -> "BackendTraits":
        """This machine's traits for `device` ("cpu" probes the CPU as vLLM does)."""
        if device != "cpu":
            return cls(device or "cuda", KERNEL_BLOCK["cuda"])
        amx, avx512_bf16 = cpu_traits()
        return cls("cpu", KERNEL_BLOCK["cpu"], None if amx else CPU_MLA_BLOCK, avx512_bf16)


@lru_cache(maxsize=1)
def cpu_traits() -> tuple[bool, bool]:
    """(AMX on x86, AVX-512 BF16): what vLLM's CPU platform asks PyTorch's cpuinfo."""
    from kit.measure.device import cpu_isa
    isa = cpu_isa()
    return isa["arch"] in ("x86_64", "AMD64") and isa["amx_tile"], isa["avx512_bf16"]


def latent_spec(arch, block_size: int, dtype_bytes: int, traits: BackendTraits) -> MLAAttentionSpec:
    """A latent attention layer: one "head" of kv_lora_rank + qk_rope_head_dim, replicated on
    every tensor-parallel rank, at the block the backend takes."""
    return MLAAttentionSpec(traits.mla_block or block_size, 1, arch.latent_size, dtype_bytes)


def state_dtypes(arch, model_dtype: str, traits: BackendTraits) -> tuple[str, str]:
    """(conv state, SSM state) dtypes: the model's for the convolution; the SSM state's
    config.json setting (Nemotron-H's mamba_ssm_cache_dtype, float32 unless said; Qwen3.5's
    mamba_ssm_dtype), else the model's; float32 on a CPU with AVX-512 BF16, but for a
    delta-net's state set to 16 bits (`MambaStateDtypeCalculator`, then the CPU platform)."""
    rec = arch.recurrent
    sixteen = rec.ssm_dtype in ("bfloat16", "float16")
    if traits.ssm_float32 and not (rec.kind == "gated_delta_net" and sixteen):
        return model_dtype, "float32"
    return model_dtype, rec.ssm_dtype if rec.ssm_dtype in STATE_DTYPE_BYTES else model_dtype


STATE_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def state_spec(arch, block_size: int, model_dtype: str, tensor_parallel_size: int,
               traits: BackendTraits, prefix_caching: bool = True) -> MambaSpec:
    """A recurrent layer's state on one rank, kept as vLLM's `mamba_cache_mode` says: "align"
    with prefix caching (vLLM's default), "none" without; Mamba-2 keeps one more state for
    its prefill's checkpoint in "align". Its shapes and dtypes are what a run allocates
    (`kit.engine.layers.state_slots`)."""
    rec, tp = arch.recurrent, tensor_parallel_size
    dtypes = state_dtypes(arch, model_dtype, traits)
    conv, ssm = (STATE_DTYPE_BYTES[d] for d in dtypes)
    state = rec.conv_elements(tp) * conv + rec.ssm_elements(tp) * ssm
    shapes = ((rec.conv_elements(tp) // (rec.conv_kernel - 1), rec.conv_kernel - 1),
              (rec.heads // tp, rec.head_dim, rec.state_dim))
    return MambaSpec(block_size, state, rec.kind, "align" if prefix_caching else "none",
                     1 if rec.kind == "mamba2" else 0, shapes=shapes, dtypes=dtypes)


def align_hybrid(specs: tuple[KVCacheSpec, ...], block_size: int,
                 traits: BackendTraits) -> tuple[tuple[KVCacheSpec, ...], tuple[str, ...]]:
    """A hybrid's specs as vLLM leaves them once the model is loaded: the attention block
    raised (never lowered) until a page holds the largest state, every state's page padded
    to the attention page; and the lines vLLM logs on the way. Others come back as they are."""
    states = [s for s in specs if isinstance(s, MambaSpec)]
    attention = [s for s in specs if isinstance(s, AttentionSpec)]
    if not states or not attention:
        return specs, ()
    per_token = attention[0].bytes_per_token
    state = max(s.state_bytes for s in states)
    kernel = max(traits.kernel_block, block_size)
    if isinstance(attention[0], MLAAttentionSpec):
        kernel = max(kernel, MLA_HYBRID_ALIGNMENT)
    block = kernel * math.ceil(state / (kernel * per_token))
    block = traits.kernel_block * math.ceil(block / traits.kernel_block)
    notes = []
    if block_size < block:
        notes.append(SETTING_BLOCK.format(block))
    block = max(block, block_size)
    page = block * per_token
    if page != state:
        notes.append(PADDING_STATE.format(100 * (page - state) / state))

    def aligned(spec):
        if isinstance(spec, MambaSpec):
            return replace(spec, block_size=block, page_size_padded=page)
        return replace(spec, block_size=block)
    return tuple(map(aligned, specs)), tuple(notes)
