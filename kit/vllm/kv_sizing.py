"""vLLM's KV cache arithmetic on vLLM's own objects, without starting an engine: vLLM's config
for the model, one `FullAttentionSpec` per layer as its attention layers make them, and vLLM's
`get_kv_cache_configs` on them. No weights: seconds for any shape."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kit.engine.kv_cache import device_label
from kit.vllm.installed import vllm_missing
from kit.vllm.log import captured_vllm_log, fail_message
from kit.vllm.model_folder import write_model_folder


@dataclass
class VLLMKVSizing:
    """What vLLM's KV cache code decides for one config and budget (no engine started)."""

    num_blocks: int | None
    block_size: int
    page_size_bytes: int | None  # one layer's block
    bytes_per_block: int | None  # all layers' blocks together
    num_tokens: int | None  # vLLM's "KV cache size: N tokens"
    max_concurrency: float | None
    log_line: str | None = None  # the line vLLM logs for it (`update_kv_cache_capacity`)
    error: str | None = None  # vLLM refused (e.g. not enough memory for one request)


def engine_config(model_folder: Path, *, block_size: int, kv_cache_dtype: str = "auto",
                  max_model_len: int, dtype: str = "auto", tensor_parallel_size: int = 1,
                  kv_cache_memory_bytes: int | None = None):
    """vLLM's `VllmConfig` for a model folder, built the way `LLM(...)` builds it."""
    from vllm.engine.arg_utils import EngineArgs
    return EngineArgs(model=str(model_folder), load_format="dummy", skip_tokenizer_init=True,
                      block_size=block_size, kv_cache_dtype=kv_cache_dtype,
                      max_model_len=max_model_len, dtype=dtype,
                      tensor_parallel_size=tensor_parallel_size,
                      kv_cache_memory_bytes=kv_cache_memory_bytes).create_engine_config()


def layer_specs(vllm_config) -> dict:
    """One `FullAttentionSpec` per decoder layer, made as vLLM's `Attention.get_kv_cache_spec`
    makes it (heads per rank, head size and cache dtype from vLLM's own config)."""
    from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype
    from vllm.v1.kv_cache_interface import FullAttentionSpec, get_kv_quant_mode
    mc, pc, cc = vllm_config.model_config, vllm_config.parallel_config, vllm_config.cache_config
    spec = FullAttentionSpec(block_size=cc.block_size, num_kv_heads=mc.get_num_kv_heads(pc),
                             head_size=mc.get_head_size(),
                             dtype=kv_cache_dtype_str_to_dtype(cc.cache_dtype, mc),
                             kv_quant_mode=get_kv_quant_mode(cc.cache_dtype))
    return {f"model.layers.{i}.self_attn.attn": spec for i in range(mc.get_num_layers(pc))}


def _resolve_layout(vllm_config, specs: dict) -> None:
    """The engine core resolves the cache layout from its attention backend before sizing."""
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.utils import (get_supported_kv_cache_layouts,
                                                  resolve_kv_cache_layout)
    backends = []
    if current_platform.is_cpu():
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
        backends = [CPUAttentionBackend]
    layouts = [[x.name for x in get_supported_kv_cache_layouts(backends)]]
    resolve_kv_cache_layout(vllm_config, layouts, list(specs.values()))


def size_with_vllm_config(vllm_config, budget_bytes: int) -> VLLMKVSizing:
    """vLLM's `get_kv_cache_configs` on vLLM's layer specs for `budget_bytes` of KV memory."""
    from vllm.v1.core.kv_cache_utils import (generate_scheduler_kv_cache_config,
                                             get_kv_cache_capacity, get_kv_cache_configs)
    specs = layer_specs(vllm_config)
    _resolve_layout(vllm_config, specs)
    page = next(iter(specs.values())).page_size_bytes
    block_size = vllm_config.cache_config.block_size
    try:
        configs = get_kv_cache_configs(vllm_config, [specs], [budget_bytes])
    except ValueError as e:  # vLLM refuses: not enough memory for one max_model_len request
        return VLLMKVSizing(None, block_size, page, page * len(specs), None, None,
                            error=str(e).splitlines()[0])
    sched = generate_scheduler_kv_cache_config(configs)
    tokens, concurrency = get_kv_cache_capacity(vllm_config, sched)
    max_model_len = vllm_config.model_config.max_model_len
    line = (f"{device_label(vllm_config.device_config.device_type)} KV cache size: "
            f"{tokens:,} tokens, Maximum concurrency for {max_model_len:,} tokens per request: "
            f"{concurrency:.2f}x")
    return VLLMKVSizing(sched.num_blocks, block_size, page, page * len(specs), tokens,
                        concurrency, line)


def vllm_kv_sizing(arch, budget_bytes: int, *, block_size: int, max_model_len: int,
                   kv_cache_dtype: str = "auto", dtype: str = "auto",
                   tensor_parallel_size: int = 1, folder: Path | None = None) -> VLLMKVSizing:
    """Ask vLLM how many blocks `budget_bytes` buys for the kit's `arch`, without an engine."""
    import tempfile
    missing = vllm_missing()
    if missing:
        return VLLMKVSizing(None, block_size, None, None, None, None, error=missing)
    with tempfile.TemporaryDirectory(prefix="kit-vllm-") as tmp:
        model = write_model_folder(arch, Path(folder or tmp) / arch.name)
        with captured_vllm_log([]):  # config chatter, a dozen lines per call: not shown
            try:
                config = engine_config(model, block_size=block_size,
                                       kv_cache_dtype=kv_cache_dtype, max_model_len=max_model_len,
                                       dtype=dtype, tensor_parallel_size=tensor_parallel_size,
                                       kv_cache_memory_bytes=budget_bytes)
            except Exception as e:  # vLLM refuses the settings themselves (a name, a size)
                return VLLMKVSizing(None, block_size, None, None, None, None,
                                    error=fail_message(e))
            return size_with_vllm_config(config, budget_bytes)
