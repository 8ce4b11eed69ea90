"""Ways to run a step function, side by side (chapter 03; chapter 04 times decode with them).

    runner = make_runner(model.forward, "guard_free", device, (input_ids,))
    hidden = runner(input_ids)            # any batch size; no guards, no recompiles

Serving strategies (`SERVING_STRATEGIES`):

- `eager`: the function itself.
- `stock`: `torch.compile` (Inductor) with the batch dimension marked dynamic; Dynamo looks
  up its cache and evaluates the entry's guards on every call, and recompiles when they fail.
- `guard_free`: the same compilation with every guard dropped (`guard_filter_fn`), and
  `torch.compiler.set_stance("fail_on_recompile")` after the first compilation, so a
  recompile would be an error instead of a silent slowdown (vLLM's
  `TorchCompileWithNoGuardsWrapper`, vllm/compilation/wrapper.py).
- `bytecode_hook`: compiled guard-free, then calls skip Dynamo altogether and run the
  bytecode Dynamo produced (vLLM's bytecode-hook dispatcher, `VLLM_USE_BYTECODE_HOOK=1`).
- `cuda_graphs` (GPU only): the guard-free compiled step captured in one CUDA graph per decode
  batch size; a call is padded to the next captured size and replayed.

Every compiled runner compiles its own copy of the function's code object, so runners built
on the same model never share Dynamo cache entries: each runner's guards and recompiles are
its own, and `discard()` empties exactly its cache (what vLLM does after the profiling run).
A runner is built warm: `make_runner` makes its first call with `example_args`, and
`compile_seconds` is the time of that call.
"""
from __future__ import annotations

import time
import types

import torch

from kit.config import ConfigError
from kit.device import synchronize

SERVING_STRATEGIES = ("eager", "stock", "guard_free", "bytecode_hook", "cuda_graphs")
# input_ids [num_seqs, seq_len]: the number of sequences (the decode batch) varies.
DEFAULT_DYNAMIC_DIMS = {0: (0,)}
# vLLM's default decode batch sizes to capture, up to max_num_seqs.
DEFAULT_CAPTURE_SIZES = (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 128, 256, 512)


def available_strategies(device: str) -> tuple[str, ...]:
    """The serving strategies that can run on `device` (CUDA graphs need a GPU)."""
    return tuple(s for s in SERVING_STRATEGIES if s != "cuda_graphs" or device == "cuda")


def check_strategy(strategy: str, known=SERVING_STRATEGIES) -> None:
    if strategy not in known:
        raise ConfigError(f"unknown strategy {strategy!r}: use one of {list(known)}")


def fresh_function(fn):
    """A copy of `fn` (function, bound method or module) with its own code object, so
    Dynamo's cache for it (kept per code object) belongs to this copy alone."""
    if isinstance(fn, torch.nn.Module):
        fn = fn.forward
    owner = getattr(fn, "__self__", None)
    func = getattr(fn, "__func__", fn)
    if not isinstance(func, types.FunctionType):
        raise ConfigError(f"cannot compile {fn!r}: give a Python function, method or module")
    copy = types.FunctionType(func.__code__.replace(), func.__globals__, func.__name__,
                              func.__defaults__, func.__closure__)
    copy.__kwdefaults__ = func.__kwdefaults__
    return (types.MethodType(copy, owner) if owner is not None else copy), copy


def mark_dynamic(args: tuple, dynamic_dims: dict) -> None:
    for index, dims in dynamic_dims.items():
        torch._dynamo.mark_dynamic(args[index], dims)


def drop_all_guards(entries):
    """guard_filter_fn keeping no guard: the compiled code serves every input."""
    return [False for _ in entries]


def count_guards(guard_manager) -> int:
    """Leaf guards of a cache entry's guard tree (what Dynamo evaluates on a lookup)."""
    root = getattr(guard_manager, "root", guard_manager)

    def walk(node):
        return len(node.get_leaf_guards()) + sum(walk(c) for c in node.get_child_managers())
    return walk(root)


class Runner:
    """A step function run one way. Call it like the function."""

    strategy = "eager"

    def __init__(self, fn, device: str):
        self.fn, self.device = fn, device
        self.compile_seconds = 0.0
        self.code = None  # the code object whose Dynamo cache serves this runner

    def warm(self, example_args: tuple) -> "Runner":
        """First call (compiles, for compiled runners), timed into `compile_seconds`."""
        t0 = time.perf_counter()
        self(*example_args)
        synchronize(self.device)
        self.compile_seconds = time.perf_counter() - t0
        return self

    def __call__(self, *args):
        return self.fn(*args)

    @property
    def graphs_compiled(self) -> int:
        return 0

    def cache_entries(self) -> list:
        if self.code is None:
            return []
        return torch._dynamo.eval_frame._debug_get_cache_entry_list(self.code)

    def guards(self) -> list[int]:
        """Guards of each cache entry of the served code, newest first."""
        return [count_guards(e.guard_manager) for e in self.cache_entries()]

    def discard(self) -> None:
        """Throw away what compiling produced; the next call compiles again."""


class Compiled(Runner):
    """torch.compile with Inductor, stock: guards evaluated on every call."""

    strategy = "stock"
    guard_filter_fn = None

    def __init__(self, fn, device: str, dynamic_dims: dict):
        super().__init__(fn, device)
        self.dynamic_dims = dynamic_dims
        self.fn, self.func = fresh_function(fn)
        self.code = self.func.__code__
        self.graphs = []  # each graph Inductor compiled for this runner
        options = {"guard_filter_fn": self.guard_filter_fn} if self.guard_filter_fn else None
        self.compiled = torch.compile(self.fn, backend=self._backend, fullgraph=True,
                                      options=options)
        self.first = True  # the next call is a first compilation: mark the dynamic dims

    def _backend(self, gm, example_inputs):
        from torch._inductor.compile_fx import compile_fx
        graph = compile_fx(gm, example_inputs)
        self.graphs.append(graph)
        return graph

    @property
    def graphs_compiled(self) -> int:
        return len(self.graphs)

    def __call__(self, *args):
        if self.first:
            mark_dynamic(args, self.dynamic_dims)
            self.first = False
        return self.compiled(*args)

    def discard(self) -> None:
        torch._dynamo.eval_frame.remove_from_cache(self.code)
        self.first = True


class GuardFree(Compiled):
    """Guards dropped; after the first compilation a recompile is an error."""

    strategy = "guard_free"
    guard_filter_fn = staticmethod(drop_all_guards)

    def __call__(self, *args):
        if self.first:
            return super().__call__(*args)
        with torch.compiler.set_stance("fail_on_recompile"):
            return self.compiled(*args)


class BytecodeHook(Compiled):
    """Compiled guard-free once through Dynamo; later calls run Dynamo's transformed bytecode
    directly, with no cache lookup at all (the code calls the compiled graph itself)."""

    strategy = "bytecode_hook"
    guard_filter_fn = staticmethod(drop_all_guards)

    def __init__(self, fn, device: str, dynamic_dims: dict):
        hook = getattr(torch._dynamo.convert_frame, "register_bytecode_hook", None)
        if hook is None:
            raise ConfigError(
                f"bytecode_hook needs torch._dynamo.convert_frame.register_bytecode_hook, "
                f"which torch {torch.__version__} lacks; use guard_free")
        super().__init__(fn, device, dynamic_dims)
        self.dispatch = None
        self._handle = hook(self._on_bytecode)

    def _on_bytecode(self, old_code, new_code):
        if old_code is self.code:  # our copy alone: other runners' code is not ours
            # Dynamo keeps arguments, cells and free variables of the original code, so the new
            # code runs as the same function (vllm/compilation/wrapper.py explains why).
            func = types.FunctionType(new_code, self.func.__globals__, self.func.__name__,
                                      self.func.__defaults__, self.func.__closure__)
            owner = getattr(self.fn, "__self__", None)
            self.dispatch = types.MethodType(func, owner) if owner is not None else func

    def __call__(self, *args):
        if self.dispatch is None:
            return super().__call__(*args)
        return self.dispatch(*args)

    def discard(self) -> None:
        super().discard()
        self.dispatch = None

    def __del__(self):
        handle = getattr(self, "_handle", None)
        if handle is not None:
            handle.remove()


class CUDAGraphs(Runner):
    """One CUDA graph per decode batch size over the guard-free compiled step; a call is
    padded to the next captured size. Larger batches run the compiled step without a graph.

    Arguments with a dynamic batch dimension (dimension 0 in `dynamic_dims`) are copied into
    static buffers before each replay; every other tensor argument (a KV cache, or a decode
    step's persistent input buffers) is captured where it lies, and later calls must pass that
    same tensor. Padding rows run too: a step that writes state (a KV cache) should be captured
    at exactly the sizes it is called with."""

    strategy = "cuda_graphs"

    def __init__(self, fn, device: str, dynamic_dims: dict, capture_sizes):
        if device != "cuda":
            raise ConfigError(f"cuda_graphs needs a CUDA device (device={device!r}); "
                              f"on this machine use one of {list(SERVING_STRATEGIES[:-1])}")
        super().__init__(fn, device)
        self.inner = GuardFree(fn, device, dynamic_dims)
        self.code = self.inner.code
        self.batch_args = sorted(i for i, dims in dynamic_dims.items() if 0 in dims)
        self.capture_sizes = sorted(capture_sizes)
        self.graphs, self.static_args, self.static_out = {}, None, {}
        self.pool = None

    @property
    def graphs_compiled(self) -> int:
        return self.inner.graphs_compiled

    def _args_at(self, size: int) -> list:
        return [a[:size] if i in self.batch_args else a for i, a in enumerate(self.static_args)]

    def warm(self, example_args: tuple) -> "Runner":
        t0 = time.perf_counter()
        self.inner(*example_args)  # compile once, batch dimension dynamic
        largest = self.capture_sizes[-1]
        self.static_args = list(example_args)
        for i in self.batch_args:
            a = example_args[i]
            self.static_args[i] = torch.zeros((largest,) + tuple(a.shape[1:]), dtype=a.dtype,
                                              device=a.device)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for size in self.capture_sizes:  # warm each size outside capture (autotuning)
                self.inner(*self._args_at(size))
        torch.cuda.current_stream().wait_stream(stream)
        for size in reversed(self.capture_sizes):  # largest first, so smaller ones share its pool
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.static_out[size] = self.inner(*self._args_at(size))
            self.pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize()
        self.compile_seconds = time.perf_counter() - t0
        return self

    def size_for(self, batch: int) -> int | None:
        return next((s for s in self.capture_sizes if s >= batch), None)

    def _check(self, args) -> None:
        for i, (a, static) in enumerate(zip(args, self.static_args)):
            if i in self.batch_args and a.shape[1:] != static.shape[1:]:
                raise ConfigError(f"cuda_graphs captured argument {i} of shape [batch, "
                                  f"{list(static.shape[1:])}], got {list(a.shape)}")
            if i not in self.batch_args and isinstance(a, torch.Tensor) and \
                    a.data_ptr() != static.data_ptr():
                raise ConfigError(f"cuda_graphs captured argument {i} in place: pass the same "
                                  "tensor on every call")

    def __call__(self, *args):
        self._check(args)
        batch = args[self.batch_args[0]].shape[0] if self.batch_args else self.capture_sizes[-1]
        size = self.size_for(batch)
        if size is None:
            return self.inner(*args)
        for i in self.batch_args:
            self.static_args[i][:batch].copy_(args[i])
            self.static_args[i][batch:size].zero_()  # padding rows: any valid token id
        self.graphs[size].replay()
        return self.static_out[size][:batch]

    def discard(self) -> None:
        self.graphs, self.static_out, self.pool = {}, {}, None
        self.inner.discard()


def make_runner(fn, strategy: str, device: str, example_args: tuple,
                dynamic_dims: dict | None = None, capture_sizes=None) -> Runner:
    """`fn` run by `strategy` (one of SERVING_STRATEGIES), already warm: its first call, with
    `example_args`, has compiled it (timed in `compile_seconds`). `dynamic_dims` maps argument
    index -> dimensions marked dynamic (default: argument 0's dimension 0, the batch).
    `capture_sizes` (cuda_graphs) are the decode batch sizes captured (default: vLLM's list up
    to the example's batch size)."""
    check_strategy(strategy)
    dims = DEFAULT_DYNAMIC_DIMS if dynamic_dims is None else dynamic_dims
    if strategy == "eager":
        runner = Runner(fn, device)
    elif strategy == "stock":
        runner = Compiled(fn, device, dims)
    elif strategy == "guard_free":
        runner = GuardFree(fn, device, dims)
    elif strategy == "bytecode_hook":
        runner = BytecodeHook(fn, device, dims)
    else:
        batch = example_args[0].shape[0]
        sizes = capture_sizes or [s for s in DEFAULT_CAPTURE_SIZES if s < batch] + [batch]
        runner = CUDAGraphs(fn, device, dims, sizes)
    return runner.warm(tuple(example_args))
