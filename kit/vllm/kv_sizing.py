"""vLLM's KV cache arithmetic on vLLM's own objects, without starting an engine: vLLM's config
for a model folder, the KV cache specs vLLM's model builds from its config.json
(`kit.vllm.model_specs`: sliding windows, layer patterns and head counts as vLLM reads them),
and vLLM's `get_kv_cache_configs` on them, as the engine core sizes the cache at start-up
(`EngineCore._initialize_kv_caches`). No weights: seconds for any shape.

For many settings of one model (chapters 02 and 05, the grid test), `VLLMSizer` builds vLLM's
config and its model's layer specs once per model folder, block size and cache dtype, then
re-runs only vLLM's sizing functions for each max_model_len, max_num_batched_tokens and budget:
a few milliseconds each instead of a model build. The specs do not depend on those three; the
test suite checks the results against freshly built configs."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from kit.vllm.installed import inspected_here, vllm_missing
from kit.vllm.log import captured_vllm_log, fail_message, logged_once
from kit.vllm.model_folder import safe_name, write_model_folder
from kit.vllm.model_specs import model_kv_specs
from kit.vllm.stand_ins import torchvision_stand_in


@dataclass(frozen=True)
class VLLMGroup:
    """One of vLLM's KV cache groups: its layers (by index), their sliding window (None: full
    attention) and the blocks one max_model_len request reserves in it; `chunk`: Llama 4's
    chunked local layers' attention_chunk_size (None: not chunked)."""

    layers: tuple[int, ...]
    window: int | None
    blocks_per_request: int
    chunk: int | None = None
    spec: str = ""  # vLLM's spec class (FullAttentionSpec, SlidingWindowSpec, MambaSpec, ...)


@dataclass
class VLLMKVSizing:
    """What vLLM's KV cache code decides for one config and budget (no engine started)."""

    num_blocks: int | None
    block_size: int
    page_size_bytes: int | None  # one layer's block
    bytes_per_block: int | None  # what one block id costs in the pool the groups share
    num_tokens: int | None  # vLLM's "KV cache size: N tokens"
    max_concurrency: float | None
    log_line: str | None = None  # the line vLLM logs for it (`update_kv_cache_capacity`)
    error: str | None = None  # vLLM refused (e.g. not enough memory for one request)
    groups: tuple[VLLMGroup, ...] = field(default_factory=tuple)

    @property
    def blocks_per_request(self) -> int | None:
        """Block ids one max_model_len request reserves, over all groups."""
        return sum(g.blocks_per_request for g in self.groups) if self.groups else None


def engine_config(model_folder: Path, *, block_size: int, kv_cache_dtype: str = "auto",
                  max_model_len: int, dtype: str = "auto", tensor_parallel_size: int = 1,
                  kv_cache_memory_bytes: int | None = None,
                  max_num_batched_tokens: int | None = None,
                  enable_prefix_caching: bool | None = None):
    """vLLM's `VllmConfig` for a model folder, built the way `LLM(...)` builds it
    (`enable_prefix_caching` None: vLLM's default; a hybrid's Mamba states are kept per block
    with it, `mamba_cache_mode` "align", and one per request without, "none")."""
    from vllm.engine.arg_utils import EngineArgs
    torchvision_stand_in(model_folder)  # Qwen3.5's module imports it (`kit.vllm.stand_ins`)
    args = EngineArgs(model=str(model_folder), load_format="dummy", skip_tokenizer_init=True,
                      block_size=block_size, kv_cache_dtype=kv_cache_dtype,
                      max_model_len=max_model_len, dtype=dtype,
                      tensor_parallel_size=tensor_parallel_size,
                      kv_cache_memory_bytes=kv_cache_memory_bytes,
                      max_num_batched_tokens=max_num_batched_tokens,
                      enable_prefix_caching=enable_prefix_caching)
    with inspected_here():
        return args.create_engine_config()


def resolve_layout(vllm_config, specs: dict) -> None:
    """The engine core resolves the cache layout from its attention backend before sizing
    (`resolve_kv_cache_layout`)."""
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.utils import (get_supported_kv_cache_layouts,
                                                  resolve_kv_cache_layout)
    backends = []
    if current_platform.is_cpu():
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
        backends = [CPUAttentionBackend]
    layouts = [[x.name for x in get_supported_kv_cache_layouts(backends)]]
    resolve_kv_cache_layout(vllm_config, layouts, list(specs.values()))


def vllm_groups(vllm_config, kv_cache_config) -> tuple[VLLMGroup, ...]:
    """vLLM's groups with each one's blocks per request, as
    `get_max_concurrency_for_kv_cache_config` counts them (max_memory_usage_bytes in pages)."""
    from vllm.model_executor.models.utils import extract_layer_index
    from vllm.utils.math_utils import cdiv
    out = []
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        blocks = cdiv(spec.max_memory_usage_bytes(vllm_config), spec.page_size_bytes)
        out.append(VLLMGroup(tuple(extract_layer_index(n) for n in group.layer_names),
                             getattr(spec, "sliding_window", None), blocks,
                             getattr(spec, "attention_chunk_size", None), type(spec).__name__))
    return tuple(out)


def size_with_specs(vllm_config, specs: dict, budget_bytes: int) -> VLLMKVSizing:
    """vLLM's `get_kv_cache_configs`, `generate_scheduler_kv_cache_config` and
    `update_kv_cache_capacity` on `specs` for `budget_bytes` of KV memory, with max_model_len
    and max_num_batched_tokens as `vllm_config` holds them now. Call it inside
    `captured_vllm_log`: the log line is read from vLLM's own record."""
    from vllm.v1.core.kv_cache_utils import (_pool_bytes_per_block,
                                             generate_scheduler_kv_cache_config,
                                             get_kv_cache_configs, update_kv_cache_capacity)
    resolve_layout(vllm_config, specs)
    page = max(s.page_size_bytes for s in specs.values())
    block_size = vllm_config.cache_config.block_size
    try:
        configs = get_kv_cache_configs(vllm_config, [specs], [budget_bytes])
    except ValueError as e:  # vLLM refuses: not enough memory for one max_model_len request
        return VLLMKVSizing(None, block_size, page, None, None, None,
                            error=str(e).splitlines()[0])
    sched = generate_scheduler_kv_cache_config(configs)
    line = logged_once(lambda: update_kv_cache_capacity(vllm_config, sched), "KV cache size:")
    cc = vllm_config.cache_config
    return VLLMKVSizing(sched.num_blocks, block_size, page,
                        _pool_bytes_per_block(vllm_config, sched.kv_cache_groups),
                        cc.kv_cache_size_tokens, cc.kv_cache_max_concurrency, line,
                        groups=vllm_groups(vllm_config, sched))


def _missing(block_size: int, error: str) -> VLLMKVSizing:
    return VLLMKVSizing(None, block_size, None, None, None, None, error=error)


def vllm_kv_sizing_for_folder(model_folder, budget_bytes: int, *, block_size: int,
                              max_model_len: int, max_num_batched_tokens: int | None = None,
                              kv_cache_dtype: str = "auto", dtype: str = "auto",
                              tensor_parallel_size: int = 1) -> VLLMKVSizing:
    """Ask vLLM how many blocks `budget_bytes` buys for the model in `model_folder` (a folder
    holding config.json, or the config.json itself), as its engine would size it at start-up;
    refusals, of the settings or of the budget, come back as `error`."""
    missing = vllm_missing()
    if missing:
        return _missing(block_size, missing)
    folder = Path(model_folder)
    folder = folder.parent if folder.name == "config.json" else folder
    with captured_vllm_log([]):  # config chatter, a dozen lines per call: not shown
        try:
            config = engine_config(folder, block_size=block_size, kv_cache_dtype=kv_cache_dtype,
                                   max_model_len=max_model_len, dtype=dtype,
                                   tensor_parallel_size=tensor_parallel_size,
                                   kv_cache_memory_bytes=budget_bytes,
                                   max_num_batched_tokens=max_num_batched_tokens)
            specs = model_kv_specs(config)
        except Exception as e:  # vLLM refuses the settings themselves (a name, a size)
            return _missing(block_size, fail_message(e))
        return size_with_specs(config, specs, budget_bytes)


def vllm_kv_sizing(arch, budget_bytes: int, *, block_size: int, max_model_len: int,
                   max_num_batched_tokens: int | None = None, kv_cache_dtype: str = "auto",
                   dtype: str = "auto", tensor_parallel_size: int = 1,
                   folder: Path | None = None) -> VLLMKVSizing:
    """`vllm_kv_sizing_for_folder` for the kit's `arch`, written as config.json
    (`write_model_folder`) into `folder` or a temporary one."""
    import tempfile
    missing = vllm_missing()
    if missing:
        return _missing(block_size, missing)
    with tempfile.TemporaryDirectory(prefix="kit-vllm-") as tmp:
        model = write_model_folder(arch, Path(folder or tmp) / safe_name(arch.name))
        return vllm_kv_sizing_for_folder(
            model, budget_bytes, block_size=block_size, max_model_len=max_model_len,
            max_num_batched_tokens=max_num_batched_tokens, kv_cache_dtype=kv_cache_dtype,
            dtype=dtype, tensor_parallel_size=tensor_parallel_size)


@dataclass
class VLLMSizer:
    """vLLM's config and layer specs for one model folder, block size and cache dtype."""

    vllm_config: object
    specs: dict
    longest: int  # the max_model_len vLLM validated at build; longer ones are refused

    @classmethod
    def build(cls, model_folder, *, block_size: int, max_model_len: int,
              kv_cache_dtype: str = "auto", dtype: str = "auto",
              tensor_parallel_size: int = 1,
              enable_prefix_caching: bool | None = None,
              records: list | None = None) -> "VLLMSizer":
        """Build once, at the longest max_model_len the sizer will be asked about (vLLM
        checks it against the model's own limit here). Raises what vLLM raises. vLLM's log
        records go to `records` when given."""
        folder = Path(model_folder)
        folder = folder.parent if folder.name == "config.json" else folder
        with captured_vllm_log([] if records is None else records):
            config = engine_config(folder, block_size=block_size, kv_cache_dtype=kv_cache_dtype,
                                   max_model_len=max_model_len, dtype=dtype,
                                   tensor_parallel_size=tensor_parallel_size,
                                   enable_prefix_caching=enable_prefix_caching)
            return cls(config, model_kv_specs(config), max_model_len)

    def size(self, budget_bytes: int, max_model_len: int, max_num_batched_tokens: int,
             records: list | None = None) -> VLLMKVSizing:
        """vLLM's sizing (`size_with_specs`) with these set on the config where `EngineArgs`
        puts them (`ModelConfig.max_model_len`, `SchedulerConfig.max_num_batched_tokens`)."""
        if max_model_len > self.longest:
            raise ValueError(f"max_model_len={max_model_len} is longer than the "
                             f"{self.longest} this sizer was built for")
        vc = self.vllm_config
        vc.model_config.max_model_len = max_model_len
        vc.scheduler_config.max_num_batched_tokens = max_num_batched_tokens
        with captured_vllm_log([] if records is None else records):
            return size_with_specs(vc, self.specs, budget_bytes)
