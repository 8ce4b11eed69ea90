"""Timings a chapter does not trust, marked where they show (chapter 04's tables, the report's
findings): the mark, what it means, and the one wording of a step against its floor."""
from __future__ import annotations

FLOOR_SHARE = "floor ÷ step"  # a step against its floor, one wording here and in the report
UNSTEADY = "⚠"
UNSTEADY_NOTE = (f"{UNSTEADY}: a median not to be trusted (its steps spread too wide, or other "
                 "work shared the CPU: the verdict printed above says which); close other work "
                 "and run the cell again")


def marked(text: str, why: str | None) -> str:
    """A timing's cell, marked when something says it is not to be trusted (`why`)."""
    return f"{text} {UNSTEADY}" if why else text


def marked_title(title: str, warnings: dict) -> str:
    """A table's title, with what its marks mean when any timing in it is marked."""
    return f"{title} · {UNSTEADY_NOTE}".lstrip(" ·") if warnings else title


def unsteady(warnings: dict, name: str) -> str | None:
    """Why `name`'s median is not to be trusted: its own spread, or the busy machine."""
    return warnings.get(name) or warnings.get("the machine")
