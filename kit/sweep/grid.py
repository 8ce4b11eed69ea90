"""The points of a sweep: the product of `--grid NAME=V1,V2,...` values, each with the fixed
`-p NAME=VALUE` parameters, every one checked before anything runs.

    --grid max_num_batched_tokens=512,1024,2048 --grid dtype=float32,bfloat16  ->  6 points

Values are Python literals where they parse as a list of them (`512,1024`, `'eager,stock','eager'`
for values that hold a comma), else comma-separated words (`float32,bfloat16`, `96MiB,2GiB`).
Nothing here imports torch or Ray.
"""
from __future__ import annotations

import ast
import itertools
import re
from pathlib import Path

from kit.config import load
from kit.errors import ConfigError
from kit.execute.notebooks import notebook_parameters

MAX_POINTS = 32  # more than this needs --yes (or --max-points)


def parse_values(text: str) -> list:
    """`V1,V2,...` as a list of values (see the module's docstring)."""
    try:
        values = ast.literal_eval(f"[{text}]")
    except (ValueError, SyntaxError):
        values = []
        for word in text.split(","):
            try:
                values.append(ast.literal_eval(word.strip()))
            except (ValueError, SyntaxError):
                values.append(word.strip())
    return values


def parse_grid(pairs: list[str]) -> dict[str, list]:
    """`--grid NAME=V1,V2,...` options as {name: values}, in the order given."""
    grid = {}
    for pair in pairs:
        name, sep, text = pair.partition("=")
        name = name.strip()
        if not sep or not name or not text.strip():
            raise ConfigError(f"--grid {pair!r}: write NAME=V1,V2,... (at least one value)")
        if name in grid:
            raise ConfigError(f"--grid {name} given twice: put all its values in one --grid")
        values = parse_values(text)
        if "" in values:
            raise ConfigError(f"--grid {pair!r}: an empty value (two commas in a row?)")
        repeated = [v for i, v in enumerate(values) if v in values[:i]]
        if repeated:
            raise ConfigError(f"--grid {name}: the value {repeated[0]!r} is given twice")
        grid[name] = values
    return grid


def expand(grid: dict[str, list]) -> list[dict]:
    """Every combination of the grid's values, the last parameter varying fastest."""
    names = list(grid)
    return [dict(zip(names, combo)) for combo in itertools.product(*grid.values())]


def point_name(index: int, params: dict) -> str:
    """A point's folder name: its number and its grid values, e.g. `03-block_size=32`."""
    parts = [f"{k}={v}" for k, v in params.items()]
    name = re.sub(r"[^A-Za-z0-9_.=+-]+", "_", "-".join(parts))[:120]
    return f"{index:02d}-{name}"


def describe_point(params: dict) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in params.items())


def check_point(preset: str, params: dict, remote: bool) -> None:
    """The settings validation of one point. With `remote` (a cluster) the device is the
    workers': "cuda" is not refused here for want of a GPU on this machine."""
    try:
        load(preset, **params)
    except ConfigError as e:
        if not (remote and "no CUDA device" in str(e)):
            raise
        load(preset, **{**params, "device": "cpu", "strategies": None})


def check(preset: str, notebooks: list[Path], grid: dict[str, list], fixed: dict,
          max_points: int = MAX_POINTS, yes: bool = False, remote: bool = False) -> list[dict]:
    """The grid's points, or a ConfigError naming what is wrong: an empty grid, a parameter both
    swept and fixed, a name no notebook takes, a value the settings refuse, too many points."""
    if not grid:
        raise ConfigError("the grid is empty: give at least one --grid NAME=V1,V2,...")
    if "preset" in grid or "preset" in fixed:
        raise ConfigError("preset is the sweep's own (--preset): run one sweep per preset")
    both = sorted(set(grid) & set(fixed))
    if both:
        raise ConfigError(f"{both} given both as --grid and as -p: sweep it or fix it")
    points = expand(grid)
    if len(points) > max_points and not yes:
        raise ConfigError(f"the grid has {len(points)} points ("
                          + " × ".join(f"{len(v)} {k}" for k, v in grid.items())
                          + f"), more than {max_points}: add --yes to run them all, or raise "
                          "--max-points")
    taken = set().union(*map(notebook_parameters, notebooks)) - {"preset"}
    unknown = sorted((set(grid) | set(fixed)) - taken)
    if unknown:
        raise ConfigError(f"unknown parameter(s) {unknown}: the notebooks take {sorted(taken)}")
    for point in points:
        try:
            check_point(preset, {**fixed, **point}, remote)
        except ConfigError as e:
            raise ConfigError(f"the point {describe_point(point)} is refused: {e}") from None
    return points
