"""`python -m kit checkpoint MODEL --out DIR [--seed N] [--dtype D]`: a random-weight
checkpoint folder (config.json and model.safetensors, Hugging Face's tensor names) for any
shape the kit knows, which transformers and vLLM load, and `model=DIR` loads back. Torch is
imported when the command runs, not when the CLI starts."""
from __future__ import annotations

import dataclasses
from pathlib import Path

from kit.config import DTYPE_ALIASES, DTYPE_BYTES, ModelConfig
from kit.errors import ConfigError


def check_dtype(dtype: str) -> str:
    dtype = DTYPE_ALIASES.get(dtype, dtype)
    if dtype not in DTYPE_BYTES:
        raise ConfigError(f"--dtype {dtype!r}: use one of {sorted(DTYPE_BYTES)}")
    return dtype


def check_out(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"--out {out} exists and is not an empty folder; name a new one")


def write_random_checkpoint(model: str, out: Path, seed: int = 0,
                            dtype: str | None = None) -> Path:
    """Weights drawn from `seed` (as every chapter draws them) for `model` (a name under
    data/models/, a config.json or a checkpoint folder), in `dtype` (default: the config's)."""
    from kit.engine.checkpoint import write_checkpoint
    from kit.engine.model import build_model
    arch = dataclasses.replace(ModelConfig.load(model), checkpoint=None)
    dtype = check_dtype(dtype or arch.torch_dtype)
    check_out(Path(out))
    return write_checkpoint(build_model(arch, dtype, "cpu", seed), Path(out))


def add_cli(sub) -> None:
    """The `checkpoint` command of `python -m kit`."""
    p = sub.add_parser("checkpoint", help="write a random-weight checkpoint folder "
                                          "(config.json + model.safetensors)")
    p.add_argument("model", help="a name under data/models/ or a path to a config.json")
    p.add_argument("--out", type=Path, required=True, help="the folder to write (new or empty)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", help="float32, bfloat16 or float16 (default: the config's)")
    p.set_defaults(func=lambda a: print(
        f"checkpoint: {write_random_checkpoint(a.model, a.out, a.seed, a.dtype)}") or 0)
