"""Which of vLLM's CPU kernels this machine takes, as vLLM itself chooses them (chapter 00, and
`kit.vllm.fused_moe`): nothing here decides for vLLM, each answer is vLLM's own code asked.

- Its kernel library: vLLM's x86 CPU build ships one per CPU kind and its platform imports one
  (`CpuPlatform.import_kernels`): `_C` for AVX-512 with BF16 (whose AMX kernels run only where
  the CPU has AMX tiles), `_C_AVX512` for AVX-512 without BF16, `_C_AVX2` for AVX2. Which one
  this process loaded is read from its memory map.
- Its attention's ISA: `_get_attn_isa` of its CPU attention backend ("amx" for bf16 at blocks of
  32 where the CPU has AMX, "neon" on ARM, else "vec", or "vec16" at other blocks).
- Its fused MoE's ISA: the first of its CPU expert kernels, in the order its MoE oracle tries
  them, that says it supports this CPU and this layer ("amx" needs AMX tiles and bf16, "neon"
  ARM and bf16, else "vec"). Asking a kernel for an ISA the CPU lacks runs instructions the
  CPU does not have, and the CPU ends the process.

vLLM is imported only when asked.
"""
from __future__ import annotations

import platform
from dataclasses import dataclass
from pathlib import Path

import torch

from kit.units import Count
from kit.vllm.installed import vllm_missing

# vLLM's x86 kernel libraries: the CPU kind each is built for (`CpuPlatform.import_kernels`)
# and so the vectors its "vec" kernels use. Elsewhere its one library, `_C`, is the platform's.
LIBRARIES = {"_C_AVX2": ("AVX2", "AVX2"), "_C_AVX512": ("AVX-512 without BF16", "AVX-512"),
             "_C": ("AVX-512 with BF16, its AMX kernels where the CPU has AMX", "AVX-512")}
X86 = platform.machine() in ("x86_64", "AMD64")
ISA_WORDS = {"amx": "AMX tiles", "vec": "{} vectors", "vec16": "{} vectors, blocks of 16",
             "neon": "ARM NEON", "vsx": "POWER VSX", "vxe": "s390x VXE", "rvv": "RISC-V vectors"}


def isa_words(isa: str, library: str) -> str:
    """vLLM's name for a kernel ISA in words, on this kernel library."""
    vectors = LIBRARIES[library][1] if X86 and library in LIBRARIES else "the CPU's"
    return ISA_WORDS.get(isa, isa).format(vectors)


def kernel_library() -> str:
    """The vLLM kernel library this process loaded (importing `vllm._custom_ops` has the platform
    load the one for this CPU), by its module name, e.g. "_C_AVX2"."""
    import vllm._custom_ops  # noqa: F401 (its import loads the library)
    loaded = {Path(line.split()[-1]).name.split(".")[0] for line in open("/proc/self/maps")
              if "/vllm/_C" in line}
    return ", ".join(sorted(loaded)) or "none loaded"


def attention_isa(dtype: torch.dtype, block_size: int, head_size: int) -> str:
    """The ISA vLLM's CPU attention takes for `dtype` at `block_size` and `head_size`."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    return _get_attn_isa(dtype, block_size, head_size)


def moe_isa(dtype: torch.dtype, hidden: int, intermediate: int, experts: int = 8,
            top_k: int = 2) -> tuple[str | None, str | None]:
    """(the ISA vLLM's unquantized CPU fused MoE takes for SiLU experts of these sizes, None),
    or (None, why none of its CPU kernels takes them), asked as its MoE oracle asks."""
    import vllm.model_executor.layers.fused_moe.modular_kernel as mk
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.config import (FusedMoEConfig,
                                                             FusedMoEParallelConfig,
                                                             RoutingMethodType)
    from vllm.model_executor.layers.fused_moe.oracle.unquantized import (UnquantizedMoeBackend,
                                                                         backend_to_kernel_cls)
    config = FusedMoEConfig(
        num_experts=experts, experts_per_token=top_k, hidden_dim=hidden,
        intermediate_size=intermediate, num_local_experts=experts, num_logical_experts=experts,
        activation=MoEActivation.SILU, device="cpu", routing_method=RoutingMethodType.Renormalize,
        moe_parallel_config=FusedMoEParallelConfig.make_no_parallel(), in_dtype=dtype)
    reasons = []
    for kernel in backend_to_kernel_cls(UnquantizedMoeBackend.CPU):
        ok, why = kernel.is_supported_config(kernel, config, None, None,
                                             mk.FusedMoEActivationFormat.Standard)
        if ok:
            return kernel.isa, None
        reasons.append(f"{kernel.isa}: {why}")
    return None, "none of vLLM's CPU MoE kernels takes it (" + "; ".join(reasons) + ")"


@dataclass
class VllmCpuKernels:
    """What vLLM takes here for one dtype: its library, its attention's and its MoE's ISA
    (`error`: why vLLM could not be asked)."""

    dtype: str
    block_size: int
    library: str | None = None
    attention: str | None = None
    moe: str | None = None
    moe_refused: str | None = None
    error: str | None = None

    def summary(self) -> dict:
        return {k: Count(v) if k == "block_size" else v for k, v in vars(self).items()
                if v is not None}

    def library_line(self) -> str:
        if self.error:
            return f"vLLM's CPU kernels could not be asked: {self.error}"
        built_for = LIBRARIES[self.library][0] if X86 and self.library in LIBRARIES \
            else platform.machine()
        return f"vLLM's kernel library here: {self.library} (built for {built_for})"

    def row(self) -> dict:
        """The ISA of each kernel, in vLLM's name and in words."""
        def shown(isa):
            return f"{isa} ({isa_words(isa, self.library)})" if isa else ""
        return {"dtype": self.dtype,
                f"vLLM's attention (blocks of {self.block_size})": shown(self.attention),
                "vLLM's fused MoE": shown(self.moe) or self.moe_refused or self.error}


def vllm_cpu_kernels(dtype: str, block_size: int, head_size: int, hidden: int,
                     intermediate: int) -> VllmCpuKernels:
    """vLLM's CPU kernels for a model of these sizes in `dtype`, asked of vLLM here; where vLLM
    is missing or cannot be imported, the result's `error` says so."""
    found = VllmCpuKernels(dtype, block_size)
    found.error = vllm_missing()
    if found.error:
        return found
    torch_dtype = getattr(torch, dtype)
    try:
        found.library = kernel_library()
        found.attention = attention_isa(torch_dtype, block_size, head_size)
        found.moe, found.moe_refused = moe_isa(torch_dtype, hidden, intermediate)
    except Exception as e:  # a vLLM whose CPU build lacks these (another version, a GPU build)
        found.error = f"{type(e).__name__}: {e}"
    return found
