"""The kit's layers: every import inside kit/ (function-level ones included) goes to the same
layer or one below it, and no module reaches itself through its imports. Quick: no torch."""
import ast
import subprocess
import sys
from pathlib import Path

import pytest

KIT = Path(__file__).resolve().parent.parent / "kit"
# bottom to top; a module may import from its own layer (without cycles) and those below
LAYERS = ["config", "measure", "engine", "vllm", "studies", "show", "pages", "execute", "sweep",
          "cli"]
BOTTOM = {"kit.config", "kit.errors", "kit.units", "kit.results"}


def module_name(path: Path) -> str:
    parts = path.relative_to(KIT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(KIT.rglob("*.py"))}


def imports_of(path: Path) -> set[str]:
    """Every kit module `path` imports, anywhere in the file."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            raise AssertionError(f"{path}: use absolute imports (from kit.x import y)")
    return {name for name in found if name in MODULES}


GRAPH = {name: imports_of(path) - {name} for name, path in MODULES.items()}


def layer(module: str) -> int | None:
    """The layer's index, or None for the package itself and `python -m kit`."""
    if module in BOTTOM:
        return 0
    parts = module.split(".")
    return LAYERS.index(parts[1]) if len(parts) > 2 or module.split(".")[-1] in LAYERS[1:] \
        else None


def test_every_module_sits_in_a_layer():
    assert {m for m in MODULES if layer(m) is None} == {"kit", "kit.__main__"}
    for m in MODULES:
        if layer(m) is not None and m not in BOTTOM:
            assert m.split(".")[1] in LAYERS, m


@pytest.mark.parametrize("module", sorted(m for m in MODULES if layer(m) is not None))
def test_imports_go_down_or_across(module):
    up = sorted(dep for dep in GRAPH[module] if layer(dep) is None or layer(dep) > layer(module))
    assert not up, f"{module} imports from layers above it: {up}"


def test_every_study_is_a_leaf():
    """No chapter's module imports another's: what chapters share lives in the layers below."""
    studies = {m for m in MODULES if m.startswith("kit.studies.")}
    leaning = {m: sorted(GRAPH[m] & studies) for m in sorted(studies) if GRAPH[m] & studies}
    assert not leaning, f"studies importing other studies: {leaning}"


def test_no_module_name_is_used_twice():
    """One file name, one concept: no two modules of the kit share a name."""
    names = [m.rsplit(".", 1)[-1] for m, p in MODULES.items() if p.name != "__init__.py"]
    assert sorted(n for n in set(names) if names.count(n) > 1) == []


def test_the_package_itself_needs_only_the_bottom_layer():
    assert GRAPH["kit"] <= BOTTOM
    assert GRAPH["kit.__main__"] == {"kit.cli.main"}


def find_cycle(graph: dict) -> list[str] | None:
    """One cycle of `graph` (a path that returns to its start), or None."""
    state = {}

    def visit(node, path):
        state[node] = "open"
        for dep in sorted(graph[node]):
            if state.get(dep) == "open":
                return path[path.index(dep):] + [dep]
            if dep not in state and (cycle := visit(dep, path + [dep])):
                return cycle
        state[node] = "done"
        return None
    for node in sorted(graph):
        if node not in state and (cycle := visit(node, [node])):
            return cycle
    return None


def test_no_import_cycles():
    assert find_cycle(GRAPH) is None, " -> ".join(find_cycle(GRAPH))


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def fresh_python(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=KIT.parent)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_settings_and_the_report_commands_start_without_torch(tmp_path):
    """Loading settings for the CPU, `python -m kit presets` and `--help` import no torch (nor
    Dynamo): validation needs only the bottom layer."""
    code = ("import sys, contextlib, io\n"
            "import kit\n"
            "assert kit.load(device='cpu').arch.name == 'tiny'\n"
            "from kit.cli.main import main\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            "    main(['presets'])\n"
            "print(sorted(m for m in ('torch', 'plotly') if m in sys.modules))")
    assert fresh_python(code) == "[]"


def test_importing_the_real_vllms_home_imports_no_vllm_and_sets_no_environment():
    """kit.vllm sets VLLM_ENABLE_V1_MULTIPROCESSING when an engine starts, not at import."""
    modules = sorted(m for m in MODULES if m.startswith("kit.vllm."))
    code = ("import os, sys\n"
            "before = dict(os.environ)\n"
            f"import {', '.join(modules)}\n"
            "print(dict(os.environ) == before, 'vllm' in sys.modules)")
    assert len(modules) >= 5 and fresh_python(code) == "True False"


def test_no_public_name_is_defined_in_two_modules():
    """One name, one meaning: no public function or class of the kit is defined at the top of
    two modules, outside kit.show and kit.pages (which draw one result several ways). `add_cli`
    is the one protocol: each command's module gives `kit.cli.main` its subcommand by it."""
    where: dict[str, list[str]] = {}
    for name, path in MODULES.items():
        if name.split(".")[1:2] in (["show"], ["pages"]):
            continue
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.name.startswith("_"):
                where.setdefault(node.name, []).append(name)
    twice = {n: ms for n, ms in where.items() if len(ms) > 1 and n != "add_cli"}
    assert not twice, f"public names defined in more than one module: {twice}"


MAX_MODULE_LINES = 450


def test_every_module_is_short():
    """One concept per module, readable in one sitting: none over MAX_MODULE_LINES lines."""
    long = {name: n for name, path in MODULES.items()
            if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"


MAX_FUNCTION_LINES = 60


def test_every_function_is_short():
    """Short functions (docstring included): none over MAX_FUNCTION_LINES lines."""
    long = {f"{name}.{node.name}": node.end_lineno - node.lineno + 1
            for name, path in MODULES.items() for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES}
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


def test_what_draws_runs_no_study():
    """kit.show and kit.pages draw what they are handed: none imports a study."""
    drawing = {m: sorted(d for d in GRAPH[m] if d.startswith("kit.studies"))
               for m in MODULES if m.split(".")[1:2] in (["show"], ["pages"])}
    assert {m: ds for m, ds in drawing.items() if ds} == {}


def test_no_module_state_is_rebound():
    """No `global` statement: behaviour is never switched by rebinding a module's name (a
    with-block's state lives in a ContextVar, as `noting_picks` keeps its picks)."""
    rebound = {name: node.names for name, path in MODULES.items()
               for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Global)}
    assert rebound == {}
