"""A profile's table as plain rows (chapter 04's step breakdown splits them; a GPU run records
them): torch.profiler's `key_averages()`, one row per event name and kind, with the times that
say where a step's time went.

Plain rows, not the profiler's objects, so that the split (`kit.measure.step_breakdown`) is a
function a test can feed, and a table recorded on one machine (`save_profile_tables`) splits
the same elsewhere (`load_profile_tables`).

What the table holds on a GPU (torch/autograd/profiler_util.py, `FunctionEvent` and
`FunctionEventAvg`, the same in torch 2.11 and 2.13): each kernel, memcpy and memset is a row of
device type CUDA whose self device time is its own duration; each host op (`aten::mm`, device
type CPU) gets as self device time the kernels launched while it was the innermost op running,
so `aten::mm` and its cuBLAS kernel carry the same microseconds (`aten::linear`, which launched
nothing itself, carries none); and a `record_function` range the profiler copies onto the GPU's
timeline is a row of device type CUDA marked as a user annotation. A CUDA graph's replay has
rows for its kernels but none for the ops that once launched them.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class ProfileRow:
    """One row of `key_averages()`, summed over the profiled steps."""

    name: str
    device_type: str        # "CPU": host ops and runtime calls; "CUDA": kernels, memcpy, memset
    count: int
    self_cpu_us: float
    self_device_us: float   # a host op's: the kernels it launched itself
    annotation: bool = False  # a user annotation (record_function) copied onto the device

    @property
    def on_device(self) -> bool:
        """Work the device did (a kernel, a copy), each once: not a host op, not an annotation
        spanning kernels that have rows of their own. The rows the profiler's own "Self CUDA
        time total" sums (`_build_table` in profiler_util.py)."""
        return self.device_type != "CPU" and not self.annotation


def device_type_name(device_type) -> str:
    """`DeviceType.CUDA` -> "CUDA" (the profiler's enum, named the same in every version)."""
    return str(device_type).rsplit(".", 1)[-1]


def row_of(event) -> ProfileRow:
    """A `FunctionEventAvg` as a row; torch before 2.4 named the device time after CUDA."""
    device_us = getattr(event, "self_device_time_total", None)
    if device_us is None:
        device_us = getattr(event, "self_cuda_time_total", 0)
    return ProfileRow(event.key, device_type_name(event.device_type), event.count,
                      event.self_cpu_time_total, device_us,
                      bool(getattr(event, "is_user_annotation", False)))


def rows_from_profile(prof) -> list[ProfileRow]:
    """A finished `torch.profiler.profile`'s table, in `key_averages()`'s order."""
    return [row_of(e) for e in prof.key_averages()]


def save_profile_tables(path, tables: dict[str, list[ProfileRow]], about: dict) -> Path:
    """Write named tables (a strategy's name -> its rows) and what they are (`about`: device,
    torch version, model, batch, steps...) as JSON, for a later session to read back and
    classify (`load_profile_tables`). Returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"about": about,
            "tables": {name: [asdict(r) for r in rows] for name, rows in tables.items()}}
    path.write_text(json.dumps(data, indent=1) + "\n")
    return path


def load_profile_tables(path) -> tuple[dict, dict[str, list[ProfileRow]]]:
    """(about, tables) as `save_profile_tables` wrote them."""
    data = json.loads(Path(path).read_text())
    return data["about"], {name: [ProfileRow(**r) for r in rows]
                           for name, rows in data["tables"].items()}
