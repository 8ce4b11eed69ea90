"""Interactive controls for JupyterLab (chapter 02's KV cache calculator)."""
from __future__ import annotations

import json
import math

import ipywidgets as w
from IPython.display import display

from kit.config import KV_CACHE_DTYPES, MODELS_DIR, known_names
from kit.show.kv_cache_plots import kv_calculator as calculator_figure
from kit.units import GiB


MAX_MODEL_LENS = [2**k for k in range(7, 18)]
MEMORY_STEP = 0.25  # the memory slider moves by 2^0.25 (about 19%)


def memory_slider(capacity_bytes: int) -> w.FloatLogSlider:
    """A log-2 slider in GiB that opens at `capacity_bytes` exactly: its steps are counted from
    there, and it reaches at least 1/4 GiB to 256 GiB and 1/4 to 4 times the capacity (a 96 MiB
    emulated device opens at 96 MiB, not at the slider's end)."""
    start = math.log2(capacity_bytes / GiB)
    below = math.ceil((start - min(-2.0, start - 2)) / MEMORY_STEP)
    above = math.ceil((max(8.0, start + 2) - start) / MEMORY_STEP)
    return w.FloatLogSlider(value=capacity_bytes / GiB, base=2, min=start - below * MEMORY_STEP,
                            max=start + above * MEMORY_STEP, step=MEMORY_STEP,
                            readout_format=".3g")


def slider_bytes(gib: float, capacity_bytes: int) -> int:
    """The slider's GiB in bytes; its starting value is the capacity to the byte."""
    return capacity_bytes if math.isclose(gib * GiB, capacity_bytes, rel_tol=1e-9) \
        else round(gib * GiB)


def calculator_controls(settings, capacity_bytes: int, layer_patterns: dict) -> dict:
    """One control per knob of the calculator, starting at the settings' values
    (`layer_patterns`: the study's patterns, name -> full_every)."""
    controls = {
        "model": w.Dropdown(options=list(dict.fromkeys([settings.model, *known_names(MODELS_DIR)])),
                            value=settings.model),
        "gpu_memory_utilization": w.FloatSlider(value=settings.gpu_memory_utilization, min=0.05,
                                                max=1.0, step=0.01),
        "device_memory_gib": memory_slider(capacity_bytes),
        "block_size": w.Dropdown(options=[8, 16, 32, 64, 128, 256], value=settings.block_size),
        "kv_cache_dtype": w.Dropdown(options=list(KV_CACHE_DTYPES), value=settings.kv_cache_dtype),
        "max_model_len": w.SelectionSlider(
            options=MAX_MODEL_LENS, value=settings.max_model_len
            if settings.max_model_len in MAX_MODEL_LENS else 1024),
        "tensor_parallel_size": w.Dropdown(options=[1, 2, 4, 8],
                                           value=settings.tensor_parallel_size),
        "full_every": w.Dropdown(options=list(layer_patterns.items()), value=0),
        "sliding_window": w.Dropdown(options=[("the model's own", 0)] + [
            (f"{n:,} tokens", n) for n in (128, 512, 1024, 4096)], value=0),
    }
    for name, control in controls.items():
        control.description = name
        control.style = {"description_width": "170px"}
        control.layout = w.Layout(width="480px")
    return controls


def numbers_html(calc, note: str = "") -> str:
    """The calculator's numbers in one line, vLLM's log line included
    (`kv_cache_sizing.Calculation`); when the model does not fit, by how much and what to
    change instead (its `fit_advice`); `note` (why the memory moved) below."""
    s, advice = calc.config, calc.fit_advice()
    line = (f"<b>{advice}</b>" if advice else
            f"<b>{s.num_blocks:,}</b> blocks · <b>{s.num_tokens:,}</b> tokens · "
            f"<b>{s.max_concurrency:.2f}×</b> concurrency · {s.layout.bytes_per_block:,} B per "
            f"block · activations {calc.activations} · <code>{s.log_line()}</code>")
    notes = [n for n in (note, calc.refusal, s.layout.block_size_note(),
                         windowed_tokens_note(calc)) if n]
    return line + "".join(f"<br><i>{n}</i>" for n in notes)


def windowed_tokens_note(calc) -> str | None:
    """Why, with sliding windows, "tokens" moves with max_model_len at a fixed number of
    blocks (None without windows or when nothing fits)."""
    s = calc.config
    if not s.layout.has_windows or not s.num_blocks:
        return None
    return (f"tokens = concurrency × max_model_len ({s.max_concurrency:.2f} × "
            f"{s.max_model_len:,}), vLLM's definition: a sliding layer keeps only its window of "
            "each request, so a longer max_model_len costs a request few more blocks and the "
            "same blocks count more tokens")


def memory_for_model(settings, capacity_bytes: int, compute, controls: dict) -> str:
    """Move the memory slider where the chosen model can be served, and say why: the
    notebook's own memory for its model; for another, unchanged if it fits there, else the
    smallest common device that holds one request of max_model_len (`compute.start_capacity`,
    among `compute.devices_gib`)."""
    memory = controls["device_memory_gib"]
    knobs = {k: c.value for k, c in controls.items() if k != "device_memory_gib"}
    with memory.hold_trait_notifications():
        if knobs["model"] in (settings.model, settings.arch.name):
            memory.value = capacity_bytes / GiB
            return ""
        here = slider_bytes(memory.value, capacity_bytes)
        if not compute(**knobs, capacity_bytes=here).missing_bytes:
            return ""
        start = compute.start_capacity(knobs)
        if start is None:
            return (f"{knobs['model']} fits none of the common devices up to "
                    f"{compute.devices_gib[-1]} GiB at these settings: raise "
                    "tensor_parallel_size")
        memory.value = start / GiB
    return (f"device_memory moved to {start / GiB:g} GiB, the smallest common GPU memory "
            f"({', '.join(map(str, compute.devices_gib))} GiB) that holds {knobs['model']}'s "
            f"weights and one {knobs['max_model_len']:,}-token request (this notebook's "
            f"device: {capacity_bytes / GiB:.3g} GiB)")


def figure_output(fig) -> dict:
    """`fig` as one display output of an Output widget, in plotly's mime type (what
    `fig.show()` sends). Set as the widget's state, not printed inside `with out:`: a headless
    run (papermill, through nbclient) can wait forever on that capture."""
    return {"output_type": "display_data", "metadata": {},
            "data": {"application/vnd.plotly.v1+json": {**json.loads(fig.to_json()), "config": {}},
                     "text/plain": f"<figure: {fig.layout.title.text}>"}}


def kv_calculator(settings, capacity_bytes: int, compute, layer_patterns: dict):
    """Controls for the knobs, a live figure and the numbers; returns the widget box.
    `compute(model=..., capacity_bytes=..., **knobs)` answers for the knobs' values (chapter
    02's `kv_cache_sizing.Calculator`); this module only draws what it returns."""
    controls = calculator_controls(settings, capacity_bytes, layer_patterns)
    numbers = w.HTML()
    numbers.add_class("kit-calculator-numbers")
    out = w.Output()

    note = [""]  # why the memory moved, shown until the next change of model

    def redraw(_=None):
        v = {k: c.value for k, c in controls.items()}
        try:
            calc = compute(model=v.pop("model"), capacity_bytes=slider_bytes(
                v.pop("device_memory_gib"), capacity_bytes), **v)
        except ValueError as e:  # e.g. tensor_parallel_size not dividing the heads
            numbers.value = f"<b>{e}</b>"
            out.outputs = ()
            return
        numbers.value = numbers_html(calc, note[0])
        out.outputs = (figure_output(calculator_figure(calc)),) if calc.config.num_blocks \
            else ()

    def model_changed(change):
        note[0] = memory_for_model(settings, capacity_bytes, compute, controls)
        redraw()

    for name, control in controls.items():
        control.observe(model_changed if name == "model" else redraw, names="value")
    redraw()
    box = w.VBox([*controls.values(), numbers, out])
    display(box)
    return box
