"""The model folders vLLM starts from: the kit's model config written as Hugging Face's
config.json, one folder per configuration, the same from run to run."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from kit.config.data import CACHE

# Where engine runs find their model folders: one per model config, the same from run to run,
# because vLLM's compile cache is keyed by the model's path among other things (a folder inside
# each run folder made every compiled start-up compile from scratch).
MODELS_CACHE = CACHE / "vllm-models"


def safe_name(name: str) -> str:
    """A model's name as one folder or file name: a Hugging Face id's `/` becomes `--`, as the
    Hub's own cache writes it (`Qwen/Qwen3-0.6B` -> `Qwen--Qwen3-0.6B`)."""
    return name.replace("/", "--")


def cached_model_folder(arch) -> Path:
    """`MODELS_CACHE/<name>-<hash of its config.json>`: a stable path per configuration."""
    digest = hashlib.sha256(json.dumps(arch.hf_dict(), sort_keys=True).encode()).hexdigest()
    return MODELS_CACHE / f"{safe_name(arch.name)}-{digest[:10]}"


def weights_folder(arch, dtype: str, seed: int) -> Path:
    """Where a side-by-side run writes the kit's own weights for vLLM to load: beside
    `cached_model_folder`, as stable a path (vLLM's compile cache keys on it)."""
    folder = cached_model_folder(arch)
    return folder.with_name(f"{folder.name}-weights-{dtype}-seed{seed}")


def write_model_folder(arch, folder: Path | None = None) -> Path:
    """A model folder holding only config.json (the kit's ModelConfig as Hugging Face writes it):
    all vLLM needs to build the model with dummy weights. Default: `cached_model_folder`."""
    folder = Path(folder) if folder is not None else cached_model_folder(arch)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(arch.hf_dict(), indent=1))
    return folder
