"""One validated configuration (the bottom layer), a module per concept:

    kit.config.data          where model shapes, presets and reference numbers live (data/)
    kit.config.families      the families the decoder builds, and how config.json is read
    kit.config.rope_params   RoPE's bases and scaling as config.json gives them
    kit.config.cache_kinds   the families whose cache is not K and V per head, as vLLM sizes them
    kit.config.deepseek      DeepSeek-V2/V3's routers, latent attention's score scale, keys read
    kit.config.hub           a model by its Hugging Face id: its config.json through the cache
    kit.config.model_config  the decoder's architecture (`ModelConfig`), checkpoint files
    kit.config.settings      the run's settings (`Settings`, `load`), dtypes, strategies

The names the rest of the kit uses are importable from `kit.config` itself.
"""
from kit.config.data import (DATA, DEFAULT_PRESET, MODELS_DIR, PRESETS_DIR, known_names,
                             read_preset, reference)
from kit.config.families import (CHUNKED, FAMILIES, FULL, INERT_KEYS, LAYER_NORMS,
                                 OUT_OF_REACH, READ_KEYS, SLIDING, Parts)
from kit.config.model_config import ModelConfig, checkpoint_files, with_layer_pattern
from kit.config.settings import (DTYPE_ALIASES, DTYPE_BYTES, KV_CACHE_DTYPES, PARAMETERS,
                                 STRATEGIES, TOLERANCE, Settings, available_strategies,
                                 check_kv_cache_dtype, check_tensor_parallel, load,
                                 notebook_settings, resolve_device)

__all__ = ["CHUNKED", "DATA", "DEFAULT_PRESET", "DTYPE_ALIASES", "DTYPE_BYTES", "FAMILIES", "FULL",
           "INERT_KEYS", "KV_CACHE_DTYPES", "LAYER_NORMS", "MODELS_DIR", "OUT_OF_REACH",
           "PARAMETERS", "PRESETS_DIR", "READ_KEYS", "SLIDING", "STRATEGIES", "TOLERANCE",
           "ModelConfig", "Parts", "Settings", "available_strategies", "check_kv_cache_dtype",
           "check_tensor_parallel", "checkpoint_files", "known_names", "load",
           "notebook_settings", "read_preset", "reference", "resolve_device",
           "with_layer_pattern"]
