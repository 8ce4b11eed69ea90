"""Interactive controls for JupyterLab (chapter 02's KV cache calculator)."""
from __future__ import annotations

import json
import math

import ipywidgets as w
from IPython.display import display

from kit.config import KV_CACHE_DTYPES, MODELS_DIR, known_names
from kit.show.kv_cache_plots import kv_calculator as calculator_figure
from kit.units import GiB, fmt_memory


MAX_MODEL_LENS = [2**k for k in range(7, 18)]
TENSOR_PARALLEL_SIZES = [1, 2, 4, 8]
UTILIZATIONS = [round(0.05 + 0.01 * i, 2) for i in range(96)]  # the slider's 0.05 to 1.0
MEMORY_STEP = 0.25  # the memory slider's own stops are 2^0.25 (about 19%) apart
NEAR_A_DEVICE = 0.1  # a stop within 10% of a common device's memory gives way to it


def memory_options(capacity_bytes: int, devices_gib) -> list[tuple[str, int]]:
    """The memory slider's stops as (label, bytes): the notebook's capacity exactly, stops
    2^0.25 apart from it reaching at least 1/4 GiB to 256 GiB and 1/4 to 4 times the
    capacity, and every common device's memory (`devices_gib`) exactly, so a memory the
    calculator moves to is one the slider shows and the numbers use, to the byte."""
    start = math.log2(capacity_bytes / GiB)
    below = math.ceil((start - min(-2.0, start - 2)) / MEMORY_STEP)
    above = math.ceil((max(8.0, start + 2) - start) / MEMORY_STEP)
    devices = {gib * GiB for gib in devices_gib}
    stops = {round(2 ** (start + i * MEMORY_STEP) * GiB) for i in range(-below, above + 1)
             if i}
    stops = {b for b in stops if all(abs(b / d - 1) > NEAR_A_DEVICE for d in devices)}
    return [(fmt_memory(b), b) for b in sorted(stops | devices | {capacity_bytes})]


def calculator_controls(settings, capacity_bytes: int, devices_gib, layer_patterns: dict
                        ) -> dict:
    """One control per knob of the calculator, starting at the settings' values, named as
    `compute` takes them (`layer_patterns`: the study's patterns, name -> full_every)."""
    controls = {
        "model": w.Dropdown(options=list(dict.fromkeys([settings.model, *known_names(MODELS_DIR)])),
                            value=settings.model),
        "gpu_memory_utilization": w.FloatSlider(value=settings.gpu_memory_utilization, min=0.05,
                                                max=1.0, step=0.01),
        "capacity_bytes": w.SelectionSlider(options=memory_options(capacity_bytes, devices_gib),
                                            value=capacity_bytes),
        "block_size": w.Dropdown(options=[8, 16, 32, 64, 128, 256], value=settings.block_size),
        "kv_cache_dtype": w.Dropdown(options=list(KV_CACHE_DTYPES), value=settings.kv_cache_dtype),
        "max_model_len": w.SelectionSlider(
            options=MAX_MODEL_LENS, value=settings.max_model_len
            if settings.max_model_len in MAX_MODEL_LENS else 1024),
        "tensor_parallel_size": w.Dropdown(options=TENSOR_PARALLEL_SIZES,
                                           value=settings.tensor_parallel_size),
        "full_every": w.Dropdown(options=list(layer_patterns.items()), value=0),
        "sliding_window": w.Dropdown(options=[("the model's own", 0)] + [
            (f"{n:,} tokens", n) for n in (128, 512, 1024, 4096)], value=0),
    }
    for name, control in controls.items():
        control.description = "device_memory" if name == "capacity_bytes" else name
        control.style = {"description_width": "170px"}
        control.layout = w.Layout(width="480px")
    return controls


def numbers_html(calc, note: str = "", advice: str | None = None) -> str:
    """The calculator's numbers in one line, vLLM's log line included
    (`kv_cache_sizing.Calculation`); when the model does not fit, `advice` (by how much and
    what to change: its `fit_advice`) instead; `note` (what moved the memory) below."""
    s, advice = calc.config, advice or calc.fit_advice()
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


def figure_output(fig) -> dict:
    """`fig` as one display output of an Output widget, in plotly's mime type (what
    `fig.show()` sends). Set as the widget's state, not printed inside `with out:`: a headless
    run (papermill, through nbclient) can wait forever on that capture."""
    return {"output_type": "display_data", "metadata": {},
            "data": {"application/vnd.plotly.v1+json": {**json.loads(fig.to_json()), "config": {}},
                     "text/plain": f"<figure: {fig.layout.title.text}>"}}


class KVCalculator:
    """Chapter 02's calculator: controls for the knobs, the numbers and a live figure.
    `compute(model=..., capacity_bytes=..., **knobs)` answers for the knobs' values (chapter
    02's `kv_cache_sizing.Calculator`: also `start_capacity`, `fixes` and `devices_gib`); this
    class only draws what it returns, and moves the memory when the model changes."""

    def __init__(self, settings, capacity_bytes: int, compute, layer_patterns: dict):
        self.settings, self.capacity, self.compute = settings, capacity_bytes, compute
        self.controls = calculator_controls(settings, capacity_bytes, compute.devices_gib,
                                            layer_patterns)
        self.numbers, self.out = w.HTML(), w.Output()
        self.numbers.add_class("kit-calculator-numbers")
        self.note = ""           # what the last change of model did to the memory
        self.set_by_you = False  # the memory is where the participant put it
        self.moving = False      # the calculator itself is moving the memory
        for name, control in self.controls.items():
            control.observe(self.on_change(name), names="value")
        self.redraw()
        self.box = w.VBox([*self.controls.values(), self.numbers, self.out])

    def knobs(self) -> dict:
        return {k: c.value for k, c in self.controls.items()}

    def reachable(self) -> dict:
        """Every value the controls that give the KV cache room can take."""
        return {"capacity_bytes": [b for _, b in self.controls["capacity_bytes"].options],
                "gpu_memory_utilization": UTILIZATIONS, "max_model_len": MAX_MODEL_LENS,
                "tensor_parallel_size": TENSOR_PARALLEL_SIZES}

    def on_change(self, name: str):
        def changed(_):
            if self.moving:
                return
            if name == "model":
                try:
                    self.note = self.memory_for_model()
                except ValueError:  # e.g. its heads and tensor_parallel_size: redraw says so
                    self.note = ""
            else:  # the note was about the settings before this change
                self.note = ""
                self.set_by_you |= name == "capacity_bytes"
            self.redraw()
        return changed

    def redraw(self):
        knobs = self.knobs()
        try:
            calc = self.compute(**knobs)
        except ValueError as e:  # e.g. tensor_parallel_size not dividing the heads
            self.numbers.value = f"<b>{e}</b>"
            self.out.outputs = ()
            return
        advice = calc.missing_bytes and calc.fit_advice(
            self.compute.fixes(knobs, self.reachable()), self.reachable()["capacity_bytes"][-1])
        self.numbers.value = numbers_html(calc, self.note, advice or None)
        self.out.outputs = (figure_output(calculator_figure(calc)),) \
            if calc.config.num_blocks else ()

    def move_memory(self, capacity_bytes: int):
        self.moving = True
        try:
            self.controls["capacity_bytes"].value = capacity_bytes
        finally:
            self.moving, self.set_by_you = False, False

    def memory_for_model(self) -> str:
        """Where the memory goes for the model just chosen, and the note that says so. It
        depends on the model and the other knobs only, not on the model chosen before: the
        notebook's memory if it is the notebook's model or fits there, else the smallest
        common device that holds one request of max_model_len (`compute.start_capacity`),
        else the largest. A memory the participant set stays where the model fits it."""
        knobs = self.knobs()
        model, here = knobs["model"], knobs.pop("capacity_bytes")
        if self.set_by_you and not self.compute(**knobs, capacity_bytes=here).missing_bytes:
            return (f"device_memory stays at {fmt_memory(here)}, where you set it (choosing "
                    "a model moves it only where the model does not fit)")
        own = model in (self.settings.model, self.settings.arch.name)
        if own or not self.compute(**knobs, capacity_bytes=self.capacity).missing_bytes:
            self.move_memory(self.capacity)
            return "" if here == self.capacity else \
                f"device_memory back to this notebook's {fmt_memory(self.capacity)}"
        start, devices = self.compute.start_capacity(knobs), self.compute.devices_gib
        self.move_memory(start or devices[-1] * GiB)
        if start is None:
            return (f"device_memory moved to {devices[-1]} GiB, the largest common GPU memory "
                    f"({', '.join(map(str, devices))} GiB): {model} fits none of them at "
                    f"tensor_parallel_size {knobs['tensor_parallel_size']}")
        return (f"device_memory moved to {fmt_memory(start)}, the smallest common GPU memory "
                f"({', '.join(map(str, devices))} GiB) that holds {model}'s weights and one "
                f"{knobs['max_model_len']:,}-token request (this notebook's device: "
                f"{fmt_memory(self.capacity)})")


def kv_calculator(settings, capacity_bytes: int, compute, layer_patterns: dict) -> KVCalculator:
    """`KVCalculator`, shown; returns it (its `box` holds the controls, numbers and figure)."""
    calculator = KVCalculator(settings, capacity_bytes, compute, layer_patterns)
    display(calculator.box)
    return calculator
