"""vLLM's KV cache sizing for many settings of one model (chapters 02 and 05, the grid test):
vLLM's config and its model's layer specs built once per model folder, block size and cache
dtype (`VLLMSizer.build`), then only vLLM's sizing functions re-run for each max_model_len,
max_num_batched_tokens and budget (`VLLMSizer.size`): a few milliseconds each instead of a
model build. The specs do not depend on those three; the test suite checks the results
against freshly built configs."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kit.vllm.kv_sizing import VLLMKVSizing, engine_config, size_with_specs
from kit.vllm.log import captured_vllm_log
from kit.vllm.model_specs import model_kv_specs


@dataclass
class VLLMSizer:
    """vLLM's config and layer specs for one model folder, block size and cache dtype."""

    vllm_config: object
    specs: dict
    longest: int  # the max_model_len vLLM validated at build; longer ones are refused

    @classmethod
    def build(cls, model_folder, *, block_size: int, max_model_len: int,
              kv_cache_dtype: str = "auto", dtype: str = "auto",
              tensor_parallel_size: int = 1) -> "VLLMSizer":
        """Build once, at the longest max_model_len the sizer will be asked about (vLLM
        checks it against the model's own limit here). Raises what vLLM raises."""
        folder = Path(model_folder)
        folder = folder.parent if folder.name == "config.json" else folder
        with captured_vllm_log([]):
            config = engine_config(folder, block_size=block_size, kv_cache_dtype=kv_cache_dtype,
                                   max_model_len=max_model_len, dtype=dtype,
                                   tensor_parallel_size=tensor_parallel_size)
            return cls(config, model_kv_specs(config), max_model_len)

    def size(self, budget_bytes: int, max_model_len: int,
             max_num_batched_tokens: int) -> VLLMKVSizing:
        """vLLM's sizing (`size_with_specs`) with these set on the config where `EngineArgs`
        puts them (`ModelConfig.max_model_len`, `SchedulerConfig.max_num_batched_tokens`)."""
        if max_model_len > self.longest:
            raise ValueError(f"max_model_len={max_model_len} is longer than the "
                             f"{self.longest} this sizer was built for")
        vc = self.vllm_config
        vc.model_config.max_model_len = max_model_len
        vc.scheduler_config.max_num_batched_tokens = max_num_batched_tokens
        with captured_vllm_log([]):
            return size_with_specs(vc, self.specs, budget_bytes)
