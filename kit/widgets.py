"""Interactive controls for JupyterLab (chapter 02's KV cache calculator)."""
from __future__ import annotations

import ipywidgets as w
from IPython.display import display

from kit.config import MODELS_DIR, ModelConfig, known_names
from kit.kv_cache import KV_CACHE_DTYPES, device_name, estimate_activation_bytes, split_budget
from kit.plots import kv_calculator as calculator_figure

GiB = 2**30


def calculate(settings, measured_activation_bytes: int, model: str | None = None, **knobs):
    """The calculator for `model` (default: the settings' model): the measured activations when
    it is the profiled model, else the kit's eager estimate."""
    profiled = model in (None, settings.model, settings.arch.name)
    arch = settings.arch if profiled else ModelConfig.load(model)
    if profiled:
        activations, source = measured_activation_bytes, "measured"
    else:
        activations, source = estimate_activation_bytes(
            arch, settings.max_num_batched_tokens, settings.max_num_seqs,
            settings.dtype_bytes), "estimated"
    knobs.setdefault("device", device_name(settings.device))  # the log line's "CPU"/"GPU"
    return split_budget(arch, settings.dtype, activation_bytes=activations, **knobs), source


def kv_calculator(settings, capacity_bytes: int, measured_activation_bytes: int):
    """Controls for the knobs, a live figure and the numbers; returns the widget box."""
    controls = {
        "model": w.Dropdown(options=list(dict.fromkeys([settings.model, *known_names(MODELS_DIR)])),
                            value=settings.model),
        "gpu_memory_utilization": w.FloatSlider(value=settings.gpu_memory_utilization, min=0.05,
                                                max=1.0, step=0.01),
        "device_memory_gib": w.FloatLogSlider(value=capacity_bytes / GiB, base=2, min=-2, max=8,
                                              step=0.25, readout_format=".2f"),
        "block_size": w.Dropdown(options=[8, 16, 32, 64, 128, 256], value=settings.block_size),
        "kv_cache_dtype": w.Dropdown(options=list(KV_CACHE_DTYPES), value=settings.kv_cache_dtype),
        "max_model_len": w.SelectionSlider(options=[2**k for k in range(7, 18)],
                                           value=settings.max_model_len
                                           if settings.max_model_len in [2**k for k in range(7, 18)]
                                           else 1024),
        "tensor_parallel_size": w.Dropdown(options=[1, 2, 4, 8],
                                           value=settings.tensor_parallel_size),
    }
    for name, control in controls.items():
        control.description = name
        control.style = {"description_width": "170px"}
        control.layout = w.Layout(width="480px")
    numbers = w.HTML()
    numbers.add_class("kit-calculator-numbers")
    out = w.Output()

    def redraw(_=None):
        v = {k: c.value for k, c in controls.items()}
        out.clear_output(wait=True)
        with out:
            try:
                split, source = calculate(
                    settings, measured_activation_bytes, v["model"],
                    capacity_bytes=int(v["device_memory_gib"] * GiB),
                    gpu_memory_utilization=v["gpu_memory_utilization"],
                    block_size=v["block_size"], kv_cache_dtype=v["kv_cache_dtype"],
                    max_model_len=v["max_model_len"], tensor_parallel_size=v["tensor_parallel_size"])
            except ValueError as e:  # e.g. tensor_parallel_size not dividing the heads
                numbers.value = f"<b>{e}</b>"
                return
            s = split.sizing
            numbers.value = (
                f"<b>{s.num_blocks:,}</b> blocks · <b>{s.num_tokens:,}</b> tokens · "
                f"<b>{s.max_concurrency:.2f}×</b> concurrency · {s.spec.bytes_per_block:,} B per "
                f"block · activations {source} · <code>{s.log_line()}</code>"
                + ("" if split.kv_bytes > 0 else
                   " · <b>No available memory for the cache blocks</b>"))
            calculator_figure(split).show()

    for control in controls.values():
        control.observe(redraw, names="value")
    redraw()
    box = w.VBox([*controls.values(), numbers, out])
    display(box)
    return box
