"""Byte and rate units, read and written one way everywhere: `parse_bytes` for what people
type (`96MiB`, `2GiB`, `16e9`), `fmt_bytes` and `fmt_flops` for what the kit shows. No torch."""
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


def fmt_flops(rate: float) -> str:
    """FLOP/s in the unit that keeps a slow CPU's 1.0 GFLOP/s from reading as 0.00 TFLOP/s."""
    return f"{rate / 1e12:,.2f} TFLOP/s" if rate >= 1e12 else f"{rate / 1e9:,.1f} GFLOP/s"
