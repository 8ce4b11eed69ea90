"""Where the kit's data lives: model shapes, presets and published reference numbers (data/)."""
from __future__ import annotations

import json
import os
from pathlib import Path

from kit.errors import ConfigError

DATA = Path(__file__).resolve().parent.parent.parent / "data"
MODELS_DIR = DATA / "models"
PRESETS_DIR = DATA / "presets"
DEFAULT_PRESET = "cpu-small"
# What the kit builds once per machine and keeps between runs: vLLM's model folders, the expert
# kernel (`kit.engine.layers.expert_kernel`).
CACHE = Path(os.environ.get("KIT_CACHE_DIR", Path.home() / ".cache" / "kit"))


def known_names(folder: Path) -> list[str]:
    return sorted(p.stem for p in folder.glob("*.json"))



def read_preset(preset: str) -> dict:
    path = PRESETS_DIR / f"{preset}.json"
    if not path.is_file():
        raise ConfigError(f"unknown preset {preset!r}: give one of {known_names(PRESETS_DIR)}")
    return json.loads(path.read_text())


def reference(name: str) -> dict:
    """Published numbers under data/reference/ shown beside measured ones: `pr7796` (vLLM pull request
    #7796, Gemma-2B on a GPU), `vllm_cpu` (vLLM's CPU engine as recorded), `mlp_probe` (the
    chapter 03 issue's tiny-MLP measurement)."""
    return json.loads((DATA / "reference" / f"{name}.json").read_text())
