"""Units, read and written one way everywhere: `parse_bytes` for what people type (`96MiB`,
`2GiB`, `16e9`), `fmt_bytes` and `fmt_flops` for what the kit shows, and the typed numbers
(`Bytes`, `Seconds`, `Ratio`, ...) a result is recorded as, so that every page shows it in its
unit (`fmt_quantity`) without guessing from its name. No torch."""
from __future__ import annotations

import re

from kit.errors import ConfigError

KiB, MiB, GiB = 2**10, 2**20, 2**30

_SIZE = re.compile(r"^\s*([0-9.]+)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": KiB, "mib": MiB, "gib": GiB, "tib": 2**40}


def parse_bytes(value) -> int | None:
    """`2GiB`, `512 MiB`, `16e9` or an int -> bytes; None stays None."""
    if value is None or isinstance(value, int):
        return value
    if isinstance(value, float):
        return int(value)
    m = _SIZE.match(str(value))
    if not m:
        raise ConfigError(f"{value!r} is not a size: write one such as 16GiB, 512MiB or a "
                          "number of bytes")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "B").lower()])


def fmt_bytes(n) -> str:
    """Bytes in the largest binary unit that keeps them at 1 or more: `96.00 MiB`."""
    if n is None:
        return "n/a"
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(n) >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{n} B"


def fmt_bytes_exact(n: int) -> str:
    """Bytes to the byte, and in the unit people read: `25,276,067,840 (23.54 GiB)`."""
    return f"{n:,} ({fmt_bytes(n)})"


def fmt_memory(n: int) -> str:
    """A device's memory as its control shows it: `96 MiB`, `16 GiB`, `16.97 GiB` (whole
    numbers without decimals, the rest to four digits, so two memories never read alike)."""
    unit, size = ("GiB", GiB) if n >= GiB else ("MiB", MiB)
    v = n / size
    return f"{v:,.0f} {unit}" if v == round(v) or v >= 1000 else f"{v:.4g} {unit}"


def fmt_flops(rate: float) -> str:
    """FLOP/s in the unit that keeps a slow CPU's 1.0 GFLOP/s from reading as 0.00 TFLOP/s."""
    return f"{rate / 1e12:,.2f} TFLOP/s" if rate >= 1e12 else f"{rate / 1e9:,.1f} GFLOP/s"


# --- typed results ----------------------------------------------------------------------------

class Quantity:
    """A number that says what it measures. The subclasses are ints or floats, so arithmetic
    and comparisons work as ever (and give plain numbers); `kit.results.Recorder` writes the
    number plain and its unit beside it, and the pages show it with `fmt_quantity`."""
    unit = ""

    @classmethod
    def of(cls, value):
        """`value` typed, and every number in a list or dict of them; None and text stay."""
        if isinstance(value, dict):
            return {k: cls.of(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [cls.of(v) for v in value]
        if value is None or isinstance(value, (str, bool)):
            return value
        return cls(value.item() if hasattr(value, "item") else value)


class Bytes(Quantity, int):
    unit = "bytes"


class Count(Quantity, int):
    """Blocks, tokens, sequences, layers: counted, shown exact."""
    unit = "count"


class Seconds(Quantity, float):
    unit = "seconds"


class BytesPerSecond(Quantity, float):
    unit = "bytes/s"


class GBPerSecond(Quantity, float):
    """Bytes per second in billions, as some results are recorded (`copy_GB_per_s`)."""
    unit = "GB/s"


class GFlopPerSecond(Quantity, float):
    unit = "GFLOP/s"


class Flop(Quantity, float):
    unit = "FLOP"


class FlopPerSecond(Quantity, float):
    unit = "FLOP/s"


class FlopPerByte(Quantity, float):
    unit = "FLOP/byte"


class TokensPerSecond(Quantity, float):
    unit = "tokens/s"


class Ratio(Quantity, float):
    """One thing over another of the same kind, named the way it reads (`kv_ratio_compiled_over_eager`
    = compiled ÷ eager): shown as 1.27×."""
    unit = "ratio"


class Fraction(Quantity, float):
    """A part of a whole, 0 to 1: shown as a percentage."""
    unit = "fraction"


class Percent(Quantity, float):
    """Already in percent (100 = all of it)."""
    unit = "percent"


class Number(Quantity, float):
    """Dimensionless and not a ratio of like things: an error, a tolerance, a score."""
    unit = "number"


def typed(values: dict, kinds: dict) -> dict:
    """`values` with the numbers that `kinds` names typed: `{Bytes: ("weights_bytes",), ...}`
    (a dataclass's fields, declared once beside it)."""
    out = dict(values)
    for kind, names in kinds.items():
        out.update({n: kind.of(out[n]) for n in names if n in out})
    return out


QUANTITIES = {q.unit: q for q in (Bytes, Count, Seconds, BytesPerSecond, GBPerSecond, Flop,
                                  FlopPerSecond, GFlopPerSecond, FlopPerByte, TokensPerSecond,
                                  Ratio, Fraction, Percent, Number)}


def fmt_seconds(s: float) -> str:
    if abs(s) < 1:
        return f"{s * 1e3:.3g} ms"
    return f"{s:.3g} s" if abs(s) < 100 else f"{s:,.0f} s"


def fmt_quantity(value, unit: str | None) -> str:
    """A recorded number in its unit. Measurements to four significant figures (about what a
    noisy machine gives), counts and bytes exact; an unknown or missing unit: the number."""
    if unit == "bytes":
        return fmt_bytes_exact(int(value)) if abs(value) >= KiB else f"{int(value):,} B"
    if unit == "seconds":
        return fmt_seconds(value)
    if unit == "bytes/s":
        return f"{value / 1e9:,.4g} GB/s"
    if unit == "FLOP/s":
        return fmt_flops(value)
    if unit in ("FLOP", "FLOP/byte", "tokens/s", "GB/s", "GFLOP/s"):
        return f"{value:,.4g} {unit}"
    if unit == "ratio":
        return f"{value:,.4g}×"
    if unit == "fraction":
        return f"{value * 100:.3g} %"
    if unit == "percent":
        return f"{value:.3g} %"
    return f"{value:,}" if isinstance(value, int) else f"{value:,.4g}"
