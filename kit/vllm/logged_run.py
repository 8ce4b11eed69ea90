"""The run a vLLM start-up log describes: its model's config.json and the settings that size
its KV cache, each from the log, from what the user gives beside it, or vLLM's default (and
which), then vLLM 0.32's own sizing code built for them (`VLLMSizer`, no engine started)."""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from kit.config.data import CACHE, MODELS_DIR
from kit.config.hub import hub_config, is_hub_id
from kit.errors import ConfigError
from kit.units import GiB
from kit.vllm.kv_sizing import VLLMKVSizing, VLLMSizer
from kit.vllm.log import fail_message
from kit.vllm.model_folder import safe_name
from kit.vllm.startup_log import StartupLog

# What sizes the KV cache, and vLLM's default where neither the log nor the user says
# (`max_num_batched_tokens`: `vllm serve`'s on a GPU; `block_size`: CacheConfig's on a GPU,
# the CPU platform's on a CPU).
DEFAULTS = {"dtype": "bfloat16", "kv_cache_dtype": "auto", "tensor_parallel_size": 1,
            "max_num_batched_tokens": 8192, "max_num_seqs": 256, "enable_prefix_caching": None,
            "gpu_memory_utilization": 0.9}
BLOCK_DEFAULTS = {"GPU": 16, "CPU": 128}
ENGINE_NAMES = {"max_model_len": "max_seq_len"}  # the engine line's names for the args' keys
SETTINGS = ("max_model_len", "block_size", *DEFAULTS)


@dataclass
class LoggedRun:
    """A logged run's model and settings; `source[name]` says where each came from ("the log",
    "given", "vLLM's default")."""

    model: str
    config: dict
    settings: dict
    source: dict = field(default_factory=dict)
    device: str = "GPU"

    @property
    def quantization(self) -> str | None:
        q = self.config.get("quantization_config") or {}
        return self.settings.get("quantization") or q.get("quant_method")

    def folder(self) -> Path:
        """A folder holding the config.json vLLM builds from (no quantization: the KV cache
        does not depend on how the weights are stored, and vLLM's CPU build refuses most)."""
        config = {k: v for k, v in self.config.items() if k != "quantization_config"}
        text = json.dumps(config, indent=1, sort_keys=True)
        folder = CACHE / "explained-models" / f"{safe_name(self.model)}-{hash_of(text)}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(text)
        return folder


def hash_of(text: str) -> str:
    import hashlib
    return hashlib.sha256(text.encode()).hexdigest()[:10]


def model_config(model: str) -> tuple[str, dict]:
    """`model` as a name under data/models/, a config.json or a folder holding one, or a Hub id
    (its config.json from the Hub's cache, fetched once): (its name, its config.json)."""
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
    if path.suffix == ".json" and path.is_file():
        return (path.parent.name if path.name == "config.json" else path.stem,
                json.loads(path.read_text()))
    local = local_name(model)
    if local:
        return local, json.loads((MODELS_DIR / f"{local}.json").read_text())
    if is_hub_id(model):
        instead = ("or give its config.json with --model PATH (a name under data/models/, a "
                   "config.json or a folder holding one)")
        return model, json.loads(hub_config(model, instead).read_text())
    raise ConfigError(f"the log's model {model!r} is not a name under data/models/, a "
                      "config.json or a Hugging Face id: give its config.json with --model PATH")


def local_name(model: str) -> str | None:
    """The file under data/models/ a model names: its own name, or a Hub id's last part
    (`Qwen/Qwen3.5-27B` -> qwen3.5-27b) when the kit ships that model's published config."""
    for name in (model, model.rsplit("/", 1)[-1].lower()):
        if re.fullmatch(r"[\w.-]+", name) and (MODELS_DIR / f"{name}.json").is_file():
            return name
    return None


def logged_settings(log: StartupLog, given: dict, config: dict) -> tuple[dict, dict]:
    """Each setting in `SETTINGS`: given, else the log's, else vLLM's default (max_model_len:
    the model's own length, as vLLM derives it from `config`); and where each came from."""
    settings, source = {}, {}
    for name in SETTINGS:
        logged = log.setting(name)
        if logged is None:
            logged = log.engine.get(ENGINE_NAMES.get(name, ""))
        if logged is None and name == "max_model_len" and log.value("max_concurrency"):
            logged = int(log.value("max_concurrency"))  # "for N tokens per request"
        if name in given:
            settings[name], source[name] = given[name], "given"
        elif logged is not None:
            settings[name], source[name] = logged, "the log"
        else:
            default = BLOCK_DEFAULTS.get(log.device or "GPU") if name == "block_size" else \
                DEFAULTS.get(name)
            settings[name], source[name] = default, "vLLM's default"
    if settings["max_model_len"] is None:
        settings["max_model_len"] = model_length(config)
        source["max_model_len"] = "vLLM's default (the model's max_position_embeddings)"
    if settings["kv_cache_dtype"] in ("auto", None) and source["kv_cache_dtype"] != "given":
        settings["kv_cache_dtype"] = "auto"
    return settings, source


def model_length(config: dict) -> int:
    """The length vLLM takes when max_model_len is not given: the config's
    max_position_embeddings (a multimodal wrapper's text_config's)."""
    length = config.get("max_position_embeddings") or (config.get("text_config") or {}).get(
        "max_position_embeddings")
    if not length:
        raise ConfigError("the log states no max_model_len and the config no "
                          "max_position_embeddings: give it with --set max_model_len=N")
    return int(length)


def logged_run(log: StartupLog, model: str | None = None, given: dict | None = None,
               ) -> LoggedRun:
    """The run `log` describes, its model `model` or the one it names."""
    given = dict(given or {})
    name = model or log.setting("model")
    if not name:
        raise ConfigError("the log names no model (no non-default args or engine config "
                          "line): give it with --model NAME|config.json|Hub id")
    name, config = model_config(str(name))
    settings, source = logged_settings(log, given, config)
    run = LoggedRun(name, config, settings, source, log.device or "GPU")
    check_matches(run, log)
    return run


def check_matches(run: LoggedRun, log: StartupLog) -> None:
    """A config that contradicts the log: vLLM resolved another architecture from the model
    it served."""
    logged = log.engine.get("architecture")
    own = (run.config.get("architectures") or [None])[0]
    if logged and own and logged != own:
        raise ConfigError(f"the log's engine served a {logged}, and the config given for "
                          f"{run.model} is a {own}: give the config of the model the log ran "
                          "(--model NAME|config.json|Hub id)")


def build_sizer(run: LoggedRun, records: list | None = None) -> VLLMSizer:
    s = run.settings
    try:
        return VLLMSizer.build(run.folder(), block_size=int(s["block_size"]),
                               max_model_len=int(s["max_model_len"]),
                               kv_cache_dtype=str(s["kv_cache_dtype"]), dtype=str(s["dtype"]),
                               tensor_parallel_size=int(s["tensor_parallel_size"]),
                               enable_prefix_caching=s["enable_prefix_caching"],
                               records=records)
    except Exception as e:  # vLLM refuses the config or the settings
        raise ConfigError(f"vLLM 0.32 cannot size {run.model} at the log's settings: "
                          f"{fail_message(e)}") from None


def size_at(sizer: VLLMSizer, run: LoggedRun, budget: int, records=None) -> VLLMKVSizing:
    s = run.settings
    return sizer.size(int(budget), int(s["max_model_len"]), int(s["max_num_batched_tokens"]),
                      records)


def budget_bounds(log: StartupLog, run: LoggedRun) -> tuple[int, int] | None:
    """The KV cache's bytes as the log pins them: exact when kv_cache_memory_bytes was set,
    else the range its rounded GiB allows."""
    exact = run.settings.get("kv_cache_memory_bytes") or log.setting("kv_cache_memory_bytes")
    if exact:
        return int(exact), int(exact)
    for key, index in (("available_kv_gib", 0), ("cpu_kv_gib", 0), ("too_long_gib", 2)):
        got = log.numbers.get(key)
        if got:
            lo, hi = got[index].bounds()
            return math.ceil(lo * GiB), math.floor(hi * GiB)
    return None


def pool_block_bytes(sizer: VLLMSizer, run: LoggedRun) -> int:
    """What one block id costs in the pool every group shares (one sizing at 1 TiB)."""
    return size_at(sizer, run, 1 << 40).bytes_per_block or 1


# The attention backends' kernel blocks the hybrid alignment rounds to: CUDA's FlashAttention
# and FlashInfer take multiples of 16, vLLM's CPU attention multiples of 32.
ALIGNMENTS = {"GPU": 16, "CPU": 32}


def hybrid_pages(specs: dict) -> tuple[int, int] | None:
    """(a Mamba state's page unpadded, an attention layer's bytes per token), or None for a
    model without both."""
    from dataclasses import replace
    from vllm.v1.kv_cache_interface import AttentionSpec, MambaSpec
    mamba = [replace(s, page_size_padded=None).page_size_bytes for s in specs.values()
             if isinstance(s, MambaSpec)]
    attn = [s.page_size_bytes // s.block_size for s in specs.values()
            if isinstance(s, AttentionSpec)]
    return (max(mamba), max(attn)) if mamba and attn else None


def aligned_block(mamba_page: int, attn_per_token: int, align: int) -> int:
    """vLLM's `_align_hybrid_block_size`: the smallest multiple of `align` tokens whose
    attention page holds a Mamba state."""
    return align * -(-mamba_page // (align * attn_per_token))


def align_to_logged_block(sizer: VLLMSizer, block: int) -> None:
    """Size with the attention block a GPU log states where vLLM's CPU platform rounded it to
    its own multiple: every attention spec at `block` tokens, the Mamba pages padded to match."""
    from dataclasses import replace
    from vllm.v1.kv_cache_interface import AttentionSpec, MambaSpec
    pages = hybrid_pages(sizer.specs)
    cache = sizer.vllm_config.cache_config
    if pages is None or cache.block_size == block:
        return
    old, attn_page = cache.block_size, block * pages[1]
    cache.block_size, cache.mamba_page_size_padded = block, attn_page
    sizer.specs = {
        name: replace(s, block_size=block) if isinstance(s, AttentionSpec) else
        replace(s, page_size_padded=attn_page,
                block_size=block if s.block_size == old else s.block_size)
        if isinstance(s, MambaSpec) else s for name, s in sizer.specs.items()}


def longest_that_fits(sizer: VLLMSizer, run: LoggedRun, budget: int) -> int | None:
    """The largest max_model_len (a multiple of the block size) one request of which `budget`
    holds, vLLM's check (`check_enough_kv_cache_memory`) at each."""
    s = run.settings
    step = int(s["block_size"])
    lo, hi = 0, min(int(s["max_model_len"]), sizer.longest) // step
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if sizer.size(budget, mid * step, int(s["max_num_batched_tokens"])).error:
            hi = mid - 1
        else:
            lo = mid
    return lo * step or None


def weight_bytes(run: LoggedRun) -> int | None:
    """The weights one rank loads, counted from the config's shapes at the served dtype (split
    over the tensor-parallel ranks), or None where the kit does not count the family."""
    from kit.config import DTYPE_BYTES, ModelConfig
    try:
        arch = ModelConfig.from_dict(run.config, run.model)
        count = arch.num_parameters()
    except Exception:  # noqa: BLE001: a family the kit sizes without counting
        return None
    return count * DTYPE_BYTES.get(str(run.settings["dtype"]), 2) // int(
        run.settings["tensor_parallel_size"])
