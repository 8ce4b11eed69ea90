"""The kit: helpers behind the notebooks of a study kit on LLM serving memory and decode speed.

Chapters: 00 setup check (`kit.device`), 01 memory profiling (`kit.model`, `kit.memory`),
02 KV cache (`kit.kv_cache`, `kit.block_table`, `kit.widgets`), 03 compile strategies
(`kit.compile`, `kit.strategies`), 04 decode timing (`kit.decode`, `kit.decode_bench`,
`kit.roofline`), 05 vLLM side by side (`kit.vllm_bridge`,
`kit.side_by_side`). Every chapter takes one `Settings` from `kit.config.load` and records through
`kit.results`; `kit.runner` runs them headless and `kit.report` turns a run folder into HTML.
"""
from kit.config import ConfigError, Settings, load

__all__ = ["ConfigError", "Settings", "load"]
__version__ = "0.1.0"
