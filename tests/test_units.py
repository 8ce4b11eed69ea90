"""Typed results: a number recorded with its unit, and every page showing it in that unit."""
import json

import pytest

from kit.config import load
from kit.pages.html import fmt, key_values
from kit.results import Recorder
from kit.units import (QUANTITIES, Bytes, Count, Fraction, Percent, Ratio, Seconds, fmt_quantity,
                       typed)


def test_a_typed_number_is_still_a_number():
    b, s = Bytes(2048), Seconds(0.25)
    assert b + 1 == 2049 and type(b + 1) is int and s * 2 == 0.5 and b.unit == "bytes"
    assert json.loads(json.dumps({"b": b, "s": s})) == {"b": 2048, "s": 0.25}
    assert Seconds.of([0.5, None, "n/a"]) == [0.5, None, "n/a"]
    assert all(type(x) is Seconds for x in Seconds.of({"a": [1, 2]})["a"])
    assert typed({"n": 3, "t": 1.5, "x": "s"}, {Count: ("n",), Seconds: ("t", "gone")}) == \
        {"n": 3, "t": 1.5, "x": "s"}


@pytest.mark.parametrize("value, unit, shown", [
    (25_276_067_840, "bytes", "25,276,067,840 (23.54 GiB)"), (512, "bytes", "512 B"),
    (0.008_461, "seconds", "8.46 ms"), (40.828, "seconds", "40.8 s"),
    (29.6e9, "bytes/s", "29.6 GB/s"), (29.6, "GB/s", "29.6 GB/s"),
    (134e9, "FLOP/s", "134.0 GFLOP/s"), (1.2706, "ratio", "1.271×"),
    (0.12, "fraction", "12 %"), (87.5, "percent", "87.5 %"), (1108, "count", "1,108"),
    (0.321006, None, "0.321"), (128.461, "number", "128.5")])
def test_each_unit_is_shown_its_way(value, unit, shown):
    assert fmt_quantity(value, unit) == shown
    assert unit is None or unit in QUANTITIES


def test_a_name_no_longer_decides_the_unit():
    # "copy_GB_per_s" once read as seconds from its suffix; "decode_step_median" as nothing
    assert fmt(29.6, "GB/s") == "29.6 GB/s" and fmt(0.0123, "seconds") == "12.3 ms"
    assert fmt(0.0123) == "0.0123" and fmt(None, "bytes") == "–" and fmt(True) == "yes"
    page = key_values({"decode_step_median": 0.0123, "x_bytes": 4096},
                      {"decode_step_median": "seconds"})
    assert "12.3 ms" in page and "4,096<" in page  # untyped bytes stay a plain number


def test_the_recorder_writes_each_numbers_unit_beside_it(tmp_path, monkeypatch):
    monkeypatch.setenv("KIT_RUN_DIR", str(tmp_path))
    rec = Recorder("units", load("cpu-small"))
    rec.record(blocks=Count(1108), nested={"peak_bytes": Bytes(4096), "note": "text"},
               steps=Seconds.of([0.01, 0.02]), plain=3.5, ratio=Ratio(1.27))
    data = json.loads((tmp_path / "units.json").read_text())
    assert data["results"]["nested"] == {"peak_bytes": 4096, "note": "text"}
    assert data["units"] == {"blocks": "count", "nested.peak_bytes": "bytes",
                             "steps": "seconds", "ratio": "ratio"}
    rec.record(nested={"share": Fraction(0.5)}, ratio=2.0)  # recorded again: old units go
    assert rec.data["units"] == {"blocks": "count", "steps": "seconds", "nested.share": "fraction"}
    assert data["settings"]["device_memory"] == 96 * 2**20


def test_settings_are_typed():
    values = load("cpu-small").as_dict()
    assert type(values["device_memory"]) is Bytes and type(values["block_size"]) is Count
    assert type(values["gpu_memory_utilization"]) is Fraction and values["dtype"] == "bfloat16"
    assert fmt_quantity(values["gpu_memory_utilization"], "fraction") == "90 %"
    assert Percent(50).unit == "percent"
