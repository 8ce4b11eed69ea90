"""The run's settings (`Settings`), validated before any heavy work, and the vocabularies they
draw on: dtypes and their tolerances, KV cache dtypes, strategies.

Every chapter builds a `Settings` with `load(preset, **overrides)` (in a notebook,
`notebook_settings(globals())` right after the parameters cell) and passes it down. Names
follow vLLM's (`max_num_batched_tokens`, `max_num_seqs`, `gpu_memory_utilization`, ...), so a
learner can move between the kit and the engine. Every error says what to change. Validating
imports torch only to ask whether CUDA is present.
"""
from __future__ import annotations

from dataclasses import InitVar, asdict, dataclass, fields

from kit.config.cache_kinds import DELTA_FAMILIES
from kit.config.data import DEFAULT_PRESET, read_preset
from kit.config.deepseek import check_latent_run
from kit.config.hybrid import check_hybrid_run
from kit.config.qwen3_next import check_gated_delta_run
from kit.config.families import runnable_families
from kit.config.model_config import ModelConfig
from kit.errors import ConfigError, brief_in_notebooks
from kit.units import Bytes, Count, Fraction, parse_bytes

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
# Largest difference allowed between two computations of the same logits or outputs (paged
# against no-cache, compiled against eager), relative to the reference's largest magnitude: a
# few units in the last place of the dtype, grown through the layers (compiled code fuses and
# reorders the arithmetic; a paged step rounds one token at a time). docs/measurements.md
# ("Tolerances", "Figures seen while building the kit") gives the errors seen.
TOLERANCE = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 4e-2}
# vLLM's kv_cache_dtype names -> bytes per element; "auto" means the model's dtype.
KV_CACHE_DTYPES = {"auto": None, "bfloat16": 2, "float16": 2, "float32": 4, "fp8": 1,
                   "fp8_e4m3": 1, "fp8_e5m2": 1}
# Ways to run the model's step (kit.engine.runners); the `strategies` setting names some.
STRATEGIES = ("eager", "stock", "guard_free", "bytecode_hook", "cuda_graphs")
DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32",
                 "float": "float32"}


def check_runnable(arch) -> None:
    """Refuses, before any work, a run of a model the kit sizes but does not build, or of
    what a DeepSeek config.json asks that the kit's decoder does not build or read
    (`kit.config.deepseek.check_latent_run`)."""
    if arch.deepseek is not None and arch.parts.runs:
        check_latent_run(arch)
    if arch.hybrid is not None and arch.parts.runs:
        check_hybrid_run(arch)
    if arch.family in DELTA_FAMILIES and arch.parts.runs:
        check_gated_delta_run(arch)
    if not arch.parts.runs:
        raise ConfigError(
            f"model {arch.name!r}: model_type {arch.family!r} keeps a cache that is not K and "
            "V per head (latent attention or recurrent states); the kit sizes it exactly as "
            "vLLM 0.32 does (chapter 02's calculator, `kv_cache_sizing.calculate(model=...)`) "
            f"but does not run it yet. Runs take {runnable_families()}.")


def check_tensor_parallel(arch: ModelConfig, tensor_parallel_size: int) -> None:
    """vLLM shards attention heads evenly over the ranks."""
    if arch.num_attention_heads % tensor_parallel_size:
        raise ConfigError(f"tensor_parallel_size={tensor_parallel_size} does not divide "
                          f"{arch.name}'s num_attention_heads={arch.num_attention_heads}")


def check_kv_cache_dtype(name: str) -> None:
    if name not in KV_CACHE_DTYPES:
        raise ConfigError(f"kv_cache_dtype={name!r}: use one of {list(KV_CACHE_DTYPES)}")


def available_strategies(device: str) -> tuple[str, ...]:
    """The strategies that can run on `device` (CUDA graphs need a GPU)."""
    return tuple(s for s in STRATEGIES if s != "cuda_graphs" or device == "cuda")


def resolve_device(name: str) -> str:
    """`auto` -> "cuda" when PyTorch sees a CUDA device, else "cpu"; "cuda" without one is
    refused. Only these two ask torch (imported here, not when the kit is imported)."""
    if name not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"device={name!r}: use 'auto', 'cpu' or 'cuda'")
    if name == "cpu":
        return name
    import torch
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device='cuda' but this machine has no CUDA device "
                          f"(torch {torch.__version__}); use device='auto' or 'cpu', or the "
                          "cpu-small preset")
    return "cuda" if torch.cuda.is_available() else "cpu"


SETTING_QUANTITIES = {"device_memory": Bytes, "kv_cache_memory_bytes": Bytes,
                     "gpu_memory_utilization": Fraction}  # every other number a count


@dataclass(frozen=True)
class Settings:
    """The run's settings. Build it with `load()`; every chapter takes one."""
    # `arch` (the ModelConfig of `model`) is set by __post_init__; it is derived, not a field.

    preset: str
    model: str
    device: str
    dtype: str
    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    gpu_memory_utilization: float
    device_memory: int | None
    block_size: int
    kv_cache_dtype: str
    tensor_parallel_size: int
    kv_cache_memory_bytes: int | None
    batch_size: int
    input_len: int
    output_len: int
    seed: int
    strategies: tuple[str, ...] | None = None  # serving strategies to run; None: all that apply
    num_iters: int = 3  # timed runs of the whole generation per strategy (vLLM's benchmark name)
    description: str = ""
    # settings to size a model's KV cache only (vLLM's sizing grid, chapter 05): a model the
    # kit sizes but does not run is taken (not a parameter: `load(..., sizing_only=True)`)
    sizing_only: InitVar[bool] = False

    def __post_init__(self, sizing_only: bool = False):
        object.__setattr__(self, "device_memory", parse_bytes(self.device_memory))
        object.__setattr__(self, "kv_cache_memory_bytes", parse_bytes(self.kv_cache_memory_bytes))
        self._check_positive()
        if self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size={self.block_size} must be a power of two "
                              "(16 is vLLM's GPU default; its CPU backend takes multiples of 32)")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(f"gpu_memory_utilization={self.gpu_memory_utilization} must be in "
                              "(0, 1]: it is the fraction of device memory the engine may use")
        arch = ModelConfig.load(self.model)
        if not sizing_only:
            check_runnable(arch)
        object.__setattr__(self, "arch", arch)
        if self.max_model_len > arch.max_position_embeddings:
            raise ConfigError(f"max_model_len={self.max_model_len} is beyond {arch.name}'s "
                              f"max_position_embeddings={arch.max_position_embeddings}; lower it")
        if self.input_len + self.output_len > self.max_model_len:
            raise ConfigError(f"input_len + output_len = {self.input_len + self.output_len} "
                              f"exceeds max_model_len={self.max_model_len}")
        check_tensor_parallel(arch, self.tensor_parallel_size)
        check_kv_cache_dtype(self.kv_cache_dtype)
        if self.batch_size > self.max_num_seqs:
            raise ConfigError(f"batch_size={self.batch_size} is above max_num_seqs="
                              f"{self.max_num_seqs}; raise max_num_seqs or lower batch_size")
        object.__setattr__(self, "dtype", self._resolve_dtype(arch))
        object.__setattr__(self, "device", resolve_device(self.device))
        object.__setattr__(self, "strategies", self._check_strategies())

    def _check_positive(self):
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len", "block_size",
                     "tensor_parallel_size", "batch_size", "input_len", "output_len",
                     "num_iters"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{name}={value!r} must be a positive whole number")
        for name in ("device_memory", "kv_cache_memory_bytes"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ConfigError(f"{name}={getattr(self, name)} must be positive")

    def _check_strategies(self) -> tuple[str, ...] | None:
        """None, a list or a comma-separated string of STRATEGIES, each one known and usable
        on this device."""
        if self.strategies is None:
            return None
        names = self.strategies.split(",") if isinstance(self.strategies, str) \
            else list(self.strategies)
        names = [n.strip() for n in names if n.strip()]
        unknown = [n for n in names if n not in STRATEGIES]
        if unknown or not names:
            what = f"unknown strategies {unknown}" if unknown else "no strategy named"
            raise ConfigError(f"strategies={self.strategies!r}: {what}; known: "
                              f"{list(STRATEGIES)} (or None for all that apply)")
        usable = available_strategies(self.device)
        unusable = [n for n in names if n not in usable]
        if unusable:
            raise ConfigError(f"strategies {unusable} cannot run on device={self.device!r}; "
                              f"here use any of {list(usable)}")
        return tuple(dict.fromkeys(names))

    def strategies_to_run(self) -> tuple[str, ...]:
        """The strategies set, or every one that runs on the device."""
        return self.strategies or available_strategies(self.device)

    def _resolve_dtype(self, arch: ModelConfig) -> str:
        dtype = arch.torch_dtype if self.dtype == "auto" else self.dtype
        dtype = DTYPE_ALIASES.get(dtype, dtype)
        if dtype not in DTYPE_BYTES:
            raise ConfigError(f"dtype={self.dtype!r}: use 'auto' or one of {sorted(DTYPE_BYTES)}")
        return dtype

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    def as_dict(self) -> dict:
        """The fields, numbers typed (`kit.units`): sizes in bytes, the utilization a fraction,
        the rest counts."""
        out = asdict(self)
        for name, value in out.items():
            kind = SETTING_QUANTITIES.get(name, Count)
            if name in SETTING_QUANTITIES or isinstance(value, int) and not isinstance(value, bool):
                out[name] = kind.of(value)
        return out


PARAMETERS = tuple(f.name for f in fields(Settings) if f.name not in ("preset", "description"))


def check_names(names) -> None:
    unknown = sorted(set(names) - set(PARAMETERS))
    if unknown:
        raise ConfigError(f"unknown parameter(s) {unknown}; known: {sorted(PARAMETERS)}")


def load(preset: str = DEFAULT_PRESET, sizing_only: bool = False, **overrides) -> Settings:
    """Settings of `preset` with `overrides` applied; a value of None keeps the preset's.
    `sizing_only`: for sizing a KV cache, where a model the kit does not run is taken."""
    check_names(overrides)
    values = read_preset(preset)
    values.update({k: v for k, v in overrides.items() if v is not None})
    return Settings(preset=preset, sizing_only=sizing_only, **values)


def notebook_settings(namespace: dict) -> Settings:
    """The settings of a notebook's parameters cell: `load(preset, **those parameters)`, read
    from `namespace` (the notebook's `globals()`, right after the parameters cell). A notebook
    declares the parameters it takes; each one's None keeps the preset's value. From here on a
    `ConfigError` shows in the notebook as its one line (`kit.errors.brief_in_notebooks`)."""
    brief_in_notebooks()
    params = {k: namespace[k] for k in PARAMETERS if k in namespace}
    return load(namespace.get("preset", DEFAULT_PRESET), **params)
