"""A decode step's expert products as one kernel (`expert_products.c`), as vLLM's CPU engine
runs its fused MoE: every picked expert's rows in one parallel region, each expert's bytes read
from memory once.

Why: a decode step's few rows make each expert's product a matrix-vector product, bound by the
bytes it reads. A product per expert (`torch._grouped_mm` on the CPU, MKL, oneDNN) opens a
parallel region per expert, and on a 2-core CPU that cost about half the step; Inductor's
generated loop (`gathered_products`) sums each output in one chain and streams at 17-23 GB/s
where the memory gives 30-40 (docs/experts.md, "Experts against vLLM's fused MoE").

The kernel is C, built on first use by the machine's C compiler for the machine it runs on
(`-march=native`: AVX-512 where there is AVX-512, AVX2 or NEON elsewhere) and kept in
`KIT_CACHE_DIR` under a name that holds the source, the compiler and the CPU's features. A
build is kept only after a trial product in a child process (`TRIAL`) lived and agreed with
Python's sums: a kernel that would crash, or multiply wrong, on this CPU is never loaded here.
Where it cannot be built or fails its trial (no C compiler, no OpenMP), `library()` says why
once and the experts multiply as they did before. One opaque op to torch.compile, like
`grouped_mm`.

A dense weight is one expert (`weight_products`): a compiled CPU decode step of a few rows
multiplies its large float32 weights here (`kit.engine.layers.linear.streams`), where Inductor's
oneDNN product of 4-8 rows took 1.2-1.5x the kernel's time.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch

from kit.config.data import CACHE
from kit.measure.in_child import try_in_child

SOURCE = Path(__file__).with_name("expert_products.c")
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]
_INT64, _PTR = ctypes.c_int64, ctypes.c_void_p


def c_compiler() -> str | None:
    """The C compiler, found as Triton finds the one it builds its launchers with
    (triton/runtime/build.py): $CC as given, else gcc, else clang on the PATH."""
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("clang")


def cpu_features() -> str:
    """What the CPU can do (its features line on Linux), so a kernel built for one CPU is never
    loaded on another that shares the cache."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.machine() + platform.processor()


# A child's trial of a built kernel (its path in argv[1]): both functions on 3 rows of 40, two
# experts of 10 rows (neither a whole number of vectors nor of a task's rows), against the sums
# in Python; plain ctypes and arrays, no torch, so it takes a few hundredths of a second.
TRIAL = """
import array, ctypes, struct, sys
lib = ctypes.CDLL(sys.argv[1])
P, N, K = 3, 10, 40
rows = array.array("f", [((p * 7 + k) % 5 - 2) / 4 for p in range(P) for k in range(K)])
ids = array.array("q", [0, 0, 1])
w = [((e * 3 + n * 5 + k) % 7 - 3) / 8 for e in range(2) for n in range(N) for k in range(K)]
want = [sum(rows[p * K + k] * w[(ids[p] * N + n) * K + k] for k in range(K))
        for p in range(P) for n in range(N)]
bf16 = array.array("H", [struct.unpack("<I", struct.pack("<f", v))[0] >> 16 for v in w])
for name, weights in (("expert_products_f32", array.array("f", w)), ("expert_products_bf16", bf16)):
    out = array.array("f", [0.0] * (P * N))
    ptrs = [ctypes.c_void_p(a.buffer_info()[0]) for a in (rows, ids, weights, out)]
    getattr(lib, name)(*ptrs, *map(ctypes.c_int64, (P, N, K)))
    if any(abs(a - b) > 1e-4 for a, b in zip(out, want)):
        sys.exit(f"{name} multiplied wrong: {list(out)[:4]} where {want[:4]}")
"""


def build(compiler: str, path: Path) -> None:
    """Compile `SOURCE` into the shared library `path` and try it in a child process (`TRIAL`);
    written aside, then moved in place, so two processes building at once each load a whole
    file, and a kernel whose trial died or multiplied wrong is never put there."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        built = Path(tmp) / path.name
        subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", str(built)],
                       check=True, capture_output=True, text=True)
        failed = try_in_child(TRIAL, str(built), timeout=60)
        if failed:
            raise OSError(f"its trial product in a child process failed: {failed}")
        os.replace(built, path)


@functools.cache
def library() -> ctypes.CDLL | None:
    """The built kernel, or None where it cannot be built here (said once, as a warning)."""
    compiler = c_compiler()
    if compiler is None:
        warnings.warn("no C compiler ($CC, gcc, clang): the experts multiply per expert")
        return None
    try:
        key = hashlib.sha256("\0".join([SOURCE.read_text(), compiler, *FLAGS, cpu_features()])
                             .encode()).hexdigest()[:16]
        path = CACHE / "kernels" / f"expert_products-{key}.so"
        if not path.exists():
            build(compiler, path)
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.CalledProcessError) as e:
        warnings.warn(f"the expert kernel did not build ({getattr(e, 'stderr', e)}): the "
                      "experts multiply per expert")
        return None
    for name in ("expert_products_f32", "expert_products_bf16"):
        getattr(lib, name).argtypes = [_PTR] * 4 + [_INT64] * 3
    return lib


KERNEL_DTYPES = (torch.float32, torch.bfloat16)  # the weights' dtypes it multiplies


@torch.library.custom_op("kit::expert_products", mutates_args=())
def expert_products(rows: torch.Tensor, weights: torch.Tensor,
                    experts: torch.Tensor) -> torch.Tensor:
    """rows [P, K] sorted by expert, `experts` [P] each row's expert, weights [E, N, K] (as
    stored, each expert's output rows) -> [P, N], row p times weights[experts[p]]ᵀ, summed in
    float32, in the rows' dtype; on the CPU, weights in `KERNEL_DTYPES`."""
    x = rows.float().contiguous()
    ids = experts.to(torch.int64).contiguous()
    w = weights.contiguous()
    out = torch.empty(x.shape[0], w.shape[1], dtype=torch.float32)
    if x.shape[0]:
        fn = getattr(library(), "expert_products_bf16" if w.dtype == torch.bfloat16 else
                     "expert_products_f32")
        fn(x.data_ptr(), ids.data_ptr(), w.data_ptr(), out.data_ptr(),
           x.shape[0], w.shape[1], w.shape[2])
    return out.to(rows.dtype)


@expert_products.register_fake
def _(rows, weights, experts):
    return rows.new_empty(rows.shape[0], weights.shape[1])


def weight_products(x: torch.Tensor, weight: torch.Tensor, bias=None) -> torch.Tensor:
    """x [..., K] times one weight [N, K]ᵀ (+ bias), float32, as the kernel's one expert: a
    dense layer's product with a decode step's few rows, each weight row read once for all."""
    rows = x.reshape(-1, x.shape[-1])
    experts = torch.zeros(rows.shape[0], dtype=torch.int64, device=x.device)
    out = expert_products(rows, weight.unsqueeze(0), experts).view(*x.shape[:-1], -1)
    return out if bias is None else out + bias
