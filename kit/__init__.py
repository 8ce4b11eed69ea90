"""The kit: helpers behind the notebooks of a study kit on LLM serving memory and decode speed.

Chapters: 00 setup check (`kit.device`), 01 memory profiling (`kit.model`, `kit.memory`),
04 decode timing (`kit.decode`, `kit.decode_bench`, `kit.roofline`),
05 vLLM side by side (`kit.vllm_bridge`, `kit.side_by_side`).
Every chapter takes one `Settings` from `kit.config.load` and records through `kit.results`.
"""
from kit.config import ConfigError, Settings, load

__all__ = ["ConfigError", "Settings", "load"]
__version__ = "0.1.0"
