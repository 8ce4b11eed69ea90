"""Chapter 02's calculator widget without a browser: the memory it moves to is the memory its
slider shows and its numbers use, the same pick gives the same numbers whatever came before,
and what it advises is within the controls' reach. Quick: no torch."""
import pytest

from kit.config import load
from kit.show.widgets import memory_options, kv_calculator
from kit.studies.kv_cache_sizing import COMMON_DEVICES_GIB, Calculator, fix_text
from kit.units import GiB, MiB, fmt_memory

KNOBS = dict(gpu_memory_utilization=0.9, block_size=16, kv_cache_dtype="auto",
             max_model_len=1024, tensor_parallel_size=1)


@pytest.fixture(scope="module")
def compute():
    s = load("cpu-small")
    return Calculator(s, 10 * 2**20)


def calculator(compute):
    return kv_calculator(compute.settings, 96 * MiB, compute, {"as configured": 0})


def test_memory_stops_hold_the_capacity_and_every_common_device_exactly():
    options = memory_options(96 * MiB, COMMON_DEVICES_GIB)
    values = [b for _, b in options]
    assert values == sorted(values) and 96 * MiB in values
    assert {g * GiB for g in COMMON_DEVICES_GIB} <= set(values)
    labels = [label for label, _ in options]
    assert len(set(labels)) == len(labels) and labels == [fmt_memory(b) for b in values]
    assert "16 GiB" in labels and "16.97 GiB" not in labels  # a stop near a device gives way
    assert values[0] <= GiB / 4 and values[-1] >= 256 * GiB
    assert fmt_memory(96 * MiB) == "96 MiB" and fmt_memory(round(16.97 * GiB)) == "16.97 GiB"


def test_a_moved_memory_is_the_one_the_numbers_use(compute):
    """The issue's numbers: mistral-7b-v0.1 at exactly 16 GiB is 182 blocks, 5.52×
    (not 406 at 16.97 GiB); Qwen3.5-27B at 80 GiB 443 blocks, 55.38×."""
    c = calculator(compute)
    memory = c.controls["capacity_bytes"]
    for model, gib, blocks in (("mistral-7b-v0.1", 16, 182), ("qwen3.5-27b", 80, 443)):
        c.controls["model"].value = model
        assert memory.value == gib * GiB and memory.label == f"{gib} GiB"
        expected = compute(model=model, capacity_bytes=gib * GiB, **KNOBS, full_every=0,
                           sliding_window=0)
        assert expected.config.num_blocks == blocks
        assert f"<b>{blocks:,}</b> blocks" in c.numbers.value
        assert f"{expected.config.max_concurrency:.2f}×" in c.numbers.value
        assert f"device_memory moved to {gib} GiB" in c.numbers.value


def test_the_same_pick_gives_the_same_numbers_whatever_came_before(compute):
    shown = []
    for before in ("deepseek-v3", "tiny", "qwen3.5-27b"):
        c = calculator(compute)
        c.controls["model"].value = before
        c.controls["model"].value = "mistral-7b-v0.1"
        shown.append((c.controls["capacity_bytes"].value, c.numbers.value))
    assert len(set(shown)) == 1 and shown[0][0] == 16 * GiB


def test_a_memory_you_set_stays_and_the_note_says_so(compute):
    c = calculator(compute)
    c.controls["model"].value = "mistral-7b-v0.1"
    c.controls["capacity_bytes"].value = 48 * GiB
    assert "moved" not in c.numbers.value  # the note was about the change before
    c.controls["model"].value = "llama-3.1-8b"
    assert c.controls["capacity_bytes"].value == 48 * GiB
    assert "device_memory stays at 48 GiB, where you set it" in c.numbers.value
    c.controls["model"].value = "qwen3.5-27b"  # does not fit 48 GiB: moved, and said
    assert c.controls["capacity_bytes"].value == 80 * GiB
    assert "device_memory moved to 80 GiB" in c.numbers.value


def test_advice_follows_the_state_and_stays_within_reach(compute):
    """deepseek-v3 fits no common device at tensor_parallel_size 1: the memory goes to the
    largest and the advice names tensor_parallel_size 8, not 1,389 GiB; at 8 it fits and no
    advice is left on screen."""
    c = calculator(compute)
    c.controls["model"].value = "deepseek-v3"
    text = c.numbers.value
    assert c.controls["capacity_bytes"].value == 192 * GiB
    assert "Does not fit" in text and "fits none of them at tensor_parallel_size 1" in text
    assert "more than the controls reach (271.5 GiB)" in text
    assert "Any one of these fits it: tensor_parallel_size 8." in text
    assert "Give device_memory at least" not in text
    c.controls["tensor_parallel_size"].value = 8
    assert "Does not fit" not in c.numbers.value and "fits none" not in c.numbers.value
    assert "<b>15,492</b> blocks" in c.numbers.value


def test_fixes_are_reachable_and_each_one_fits(compute):
    knobs = dict(KNOBS, model="mistral-7b-v0.1", capacity_bytes=16 * GiB, max_model_len=131072)
    reachable = {"capacity_bytes": [16 * GiB, 20 * GiB, 24 * GiB],
                 "gpu_memory_utilization": [0.9, 0.95, 1.0],
                 "max_model_len": [1024, 4096, 131072], "tensor_parallel_size": [1, 2, 4, 8]}
    fixes = compute.fixes(knobs, reachable)
    assert fixes == [{"capacity_bytes": 20 * GiB}, {"gpu_memory_utilization": 0.95},
                     {"max_model_len": 4096}, {"tensor_parallel_size": 2}]
    for fix in fixes:
        assert not compute(**{**knobs, **fix}).missing_bytes
    assert fix_text({"tensor_parallel_size": 8, "capacity_bytes": 192 * GiB}) == \
        "tensor_parallel_size 8 with device_memory 192 GiB"
    # out of reach for every knob alone: the least tensor_parallel_size with the least memory
    far = dict(knobs, model="deepseek-v3", capacity_bytes=96 * MiB, max_model_len=1024)
    reach = dict(reachable, capacity_bytes=[96 * MiB, 141 * GiB, 192 * GiB])
    assert compute.fixes(far, reach) == [{"tensor_parallel_size": 8, "capacity_bytes": 192 * GiB}]
    assert compute.fixes(far, dict(reach, tensor_parallel_size=[1, 2])) == []
    advice = compute(**far).fit_advice([], 192 * GiB)
    assert "no knob alone makes it fit" in advice and "more than the controls reach" in advice
