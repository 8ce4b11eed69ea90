"""The lesson of sliding windows measured through vLLM's own code (chapter 02's figure): maximum
concurrency against max_model_len for a model as vLLM sizes it, beside the same model with every
layer full attention. vLLM's config, its model's specs and its sizing functions answer both
(`kit.vllm.kv_sizing`); the kit's arithmetic is not used here."""
from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

from kit.vllm.installed import vllm_missing
from kit.vllm.log import fail_message
from kit.vllm.kv_sizing import VLLMSizer


@dataclass
class ConcurrencyCurve:
    """vLLM's maximum concurrency at each max_model_len, windowed and all full attention (None
    where vLLM refuses: one request does not fit), with the blocks one request reserves."""

    model: str
    budget_bytes: int
    block_size: int
    max_num_batched_tokens: int
    max_model_lens: list[int]
    windowed: list[float | None]
    full: list[float | None]
    windowed_blocks: list[int | None]
    full_blocks: list[int | None]
    error: str | None = None

    def gain(self) -> list[float | None]:
        """How many times the windows multiply concurrency (below 1: they cost a block more)."""
        return [w / f if w and f else None for w, f in zip(self.windowed, self.full)]


def config_dict(model) -> dict:
    """The config.json of `model`: the kit's ModelConfig (as `hf_dict` writes it), a folder
    holding config.json, or the config.json file itself."""
    if hasattr(model, "hf_dict"):
        return model.hf_dict()
    path = Path(model)
    return json.loads((path if path.suffix == ".json" else path / "config.json").read_text())


def all_full_attention(hf: dict) -> dict:
    """The same config with no sliding window anywhere: `sliding_window` null, `layer_types`
    all full attention, `use_sliding_window` off (the keys vLLM's models read for windows)."""
    out = {**hf, "sliding_window": None}
    if "layer_types" in hf:
        out["layer_types"] = ["full_attention"] * len(hf["layer_types"])
    for key in ("use_sliding_window", "sliding_window_pattern"):
        out.pop(key, None)
    return out


def _folder_name(path: Path) -> str:
    return path.parent.name if path.name == "config.json" else path.stem


def _sizes(sizer: VLLMSizer, budget: int, lens, batched: int):
    results = [sizer.size(budget, n, batched) for n in lens]
    return ([r.max_concurrency for r in results], [r.blocks_per_request for r in results])


def concurrency_curve(model, budget_bytes: int, *, block_size: int = 32,
                      max_num_batched_tokens: int = 2048, max_model_lens=(512, 1024, 2048, 4096,
                                                                          8192, 16384, 32768),
                      dtype: str = "bfloat16", name: str | None = None) -> ConcurrencyCurve:
    """vLLM's maximum concurrency against max_model_len for `model` (a ModelConfig, a model
    folder or a config.json) and for it with every layer full attention (`all_full_attention`):
    vLLM's `get_kv_cache_configs` and `get_kv_cache_capacity` on the specs its model builds."""
    lens = sorted(max_model_lens)
    hf = config_dict(model)
    name = name or getattr(model, "name", None) or _folder_name(Path(model))
    curve = ConcurrencyCurve(name, budget_bytes, block_size, max_num_batched_tokens, lens,
                             [], [], [], [])
    curve.error = vllm_missing()
    if curve.error:
        return curve
    with tempfile.TemporaryDirectory(prefix="kit-vllm-curve-") as tmp:
        for key, config in (("windowed", hf), ("full", all_full_attention(hf))):
            folder = Path(tmp) / key
            folder.mkdir()
            (folder / "config.json").write_text(json.dumps(config, indent=1))
            try:
                sizer = VLLMSizer.build(folder, block_size=block_size, max_model_len=lens[-1],
                                        dtype=dtype)
            except Exception as e:  # vLLM refuses the settings (a length, a block size)
                curve.error = fail_message(e)
                return curve
            conc, blocks = _sizes(sizer, budget_bytes, lens, max_num_batched_tokens)
            setattr(curve, key, conc)
            setattr(curve, f"{key}_blocks", blocks)
    return curve
