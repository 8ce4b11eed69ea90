"""Runners: a step function run by one strategy (chapter 03 compares them; chapters 01, 04 and
05 run the model's steps through them).

    runner = make_runner(model.forward, "guard_free", device, (input_ids,))
    hidden = runner(input_ids)            # any batch size; no guards, no recompiles

The strategies (`kit.config.STRATEGIES`), each a way of running the model:

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
Runners given one `CompiledGraphs` (chapter 04's compiled strategies, on one model and one
batch) compile the step once: the first runner's Inductor output serves the others, whose first
call is then Dynamo's trace alone (`reused_from` names the strategy that compiled it).
A runner is built warm: `make_runner` makes its first call with `example_args`, and
`compile_seconds` is the time of that call. `cuda_graphs` then runs each capture size once and
captures its graph; that time is `capture_seconds` (0 for the other runners), reported apart as
vLLM does: "torch.compile took N s in total" (vllm/compilation/monitor.py) apart from "Graph
capturing finished in N secs" (`capture_model` in vllm/v1/worker/gpu_model_runner.py, which
times each size's warm-up runs and capture together).
"""
from __future__ import annotations

import time
import types
import weakref

import torch

from kit.config import STRATEGIES
from kit.engine.frozen_graph_cache import packed_weights_cached
from kit.errors import ConfigError
from kit.measure.device import synchronize

# input_ids [num_seqs, seq_len]: the number of sequences (the decode batch) varies.
DEFAULT_DYNAMIC_DIMS = {0: (0,)}
# vLLM's default decode batch sizes to capture, up to max_num_seqs.
DEFAULT_CAPTURE_SIZES = (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 128, 256, 512)


def check_strategy(strategy: str, known=STRATEGIES) -> None:
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


def as_dims(dims) -> tuple:
    return (dims,) if isinstance(dims, int) else tuple(dims)


def mark_dynamic(args: tuple, dynamic_dims: dict) -> None:
    for index, dims in dynamic_dims.items():
        torch._dynamo.mark_dynamic(args[index], list(as_dims(dims)))


def drop_all_guards(entries):
    """guard_filter_fn keeping no guard: the compiled code serves every input."""
    return [False for _ in entries]


def count_guards(guard_manager) -> int:
    """Leaf guards of a cache entry's guard tree (what Dynamo evaluates on a lookup)."""
    root = getattr(guard_manager, "root", guard_manager)

    def walk(node):
        return len(node.get_leaf_guards()) + sum(walk(c) for c in node.get_child_managers())
    return walk(root)


class CompiledGraphs:
    """Inductor's output kept for the runners of one model and one batch. The compiled
    strategies differ in how a call reaches the compiled code (guards, no guards, Dynamo's
    bytecode called directly), not in the code: Dynamo traces the same FX graph for each, so
    the first runner compiles it and the others take its output. On the CPU this is where the
    time goes (Inductor's own FX graph cache, which frozen graphs enter through
    `packed_weights_cached`, still runs the freezing passes before it looks up the graph: 4 s a
    strategy for cpu-small's decode step on a Zen 4, 10 s emulating AVX2, against 11 and 16 s
    generating it), and each frozen graph holds its own copy of the weights. A graph is reused
    only for the same FX code, inputs of the same shapes, strides and dtypes, the same
    parameter and buffer objects at the same versions (what freezing folds in) and the same
    Inductor settings. The caller scopes it (one study's runners) and clears it: the graphs it
    holds keep their frozen weights alive."""

    def __init__(self):
        self.graphs = {}  # key -> (compiled graph, the strategy that compiled it)

    @staticmethod
    def key(gm, example_inputs) -> tuple:
        def meta(x):
            if torch.is_tensor(x):
                return tuple(map(str, x.shape)), tuple(map(str, x.stride())), x.dtype, x.device
            return type(x).__name__, str(x)
        held = [*gm.named_parameters(), *gm.named_buffers()]
        settings = torch._inductor.config.get_config_copy()
        return (gm.code, tuple(meta(x) for x in example_inputs),  # (inference tensors: no version)
                tuple((name, id(t), None if t.is_inference() else t._version) for name, t in held),
                repr(sorted(settings.items(), key=lambda item: item[0])))

    def compile(self, gm, example_inputs, strategy: str):
        """(graph, None) compiled now by Inductor, or (graph, strategy that compiled it)."""
        from torch._inductor.compile_fx import compile_fx
        key = self.key(gm, example_inputs)
        if key in self.graphs:
            return self.graphs[key]
        graph = compile_fx(gm, example_inputs)
        self.graphs[key] = (graph, strategy)
        return graph, None

    def clear(self) -> None:
        self.graphs.clear()


class Runner:
    """A step function run one way. Call it like the function."""

    strategy = "eager"
    reused_from = None  # compiled runners given a CompiledGraphs: who compiled their graph

    def __init__(self, fn, device: str):
        self.fn, self.device = fn, device
        self.compile_seconds = 0.0
        self.capture_seconds = 0.0  # CUDA graphs' warm-up runs and captures (cuda_graphs only)
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

    def __init__(self, fn, device: str, dynamic_dims: dict, shared: CompiledGraphs | None = None):
        super().__init__(fn, device)
        self.dynamic_dims, self.shared = dynamic_dims, shared
        self.fn, self.func = fresh_function(fn)
        self.code = self.func.__code__
        self.graphs = []  # each graph Inductor compiled for this runner
        self._capture = None
        options = {"guard_filter_fn": self.guard_filter_fn} if self.guard_filter_fn else None
        self.compiled = torch.compile(self.fn, backend=self._backend, fullgraph=True,
                                      options=options)
        self.first = True  # the next call is a first compilation: mark the dynamic dims

    def _backend(self, gm, example_inputs):
        """Inductor, as backend="inductor" runs it, keeping each compiled graph so that it can
        also be called directly, without Dynamo in front (see `direct_call`)."""
        if self.shared is not None:
            graph, self.reused_from = self.shared.compile(gm, example_inputs, self.strategy)
        else:
            from torch._inductor.compile_fx import compile_fx
            graph = compile_fx(gm, example_inputs)
        self.graphs.append(graph)

        def call(*args):  # Dynamo's transformed code calls the graph with flat inputs
            if self._capture is not None:  # one call's inputs, kept for `direct_call`
                self._capture.append((graph, args))
            return graph(*args)
        return call

    def direct_call(self, *args):
        """A zero-argument callable running the compiled graph that serves `args` directly,
        with the inputs Dynamo hands it (the arguments, flattened with the parameters and the
        symbolic sizes): the same work as `self(*args)` minus Dynamo's per-call cost."""
        self._capture = []
        try:
            self(*args)
        finally:
            captured, self._capture = self._capture, None
        if len(captured) != 1:
            raise RuntimeError(f"expected one compiled graph per call, saw {len(captured)}")
        graph, inputs = captured[0]
        return lambda: graph(*inputs)

    @property
    def graphs_compiled(self) -> int:
        return len(self.graphs)

    def __call__(self, *args):
        if self.first:
            mark_dynamic(args, self.dynamic_dims)
            self.first = False
            # Dynamo remembers the sizes a function saw by its file, line and name, which
            # every runner's copy shares: after a runner for another batch, the sizes that
            # differ would come out dynamic ("automatic dynamic"). Each runner compiles the
            # shapes it is given, with only `dynamic_dims` dynamic.
            with torch._dynamo.config.patch(automatic_dynamic_shapes=False):
                return self.compiled(*args)
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

    def __init__(self, fn, device: str, dynamic_dims: dict, shared: CompiledGraphs | None = None):
        hook = getattr(torch._dynamo.convert_frame, "register_bytecode_hook", None)
        if hook is None:
            raise ConfigError(
                f"bytecode_hook needs torch._dynamo.convert_frame.register_bytecode_hook, "
                f"which torch {torch.__version__} lacks; use guard_free")
        super().__init__(fn, device, dynamic_dims, shared)
        self.dispatch = None
        me = weakref.ref(self)  # the hook registry is global: it must not keep runners alive

        def on_bytecode(old_code, new_code):
            runner = me()
            if runner is not None:
                runner._on_bytecode(old_code, new_code)
        weakref.finalize(self, hook(on_bytecode).remove)

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


def capture_sizes_up_to(largest: int) -> list[int]:
    """vLLM's decode batch sizes to capture, up to and including `largest`."""
    return [s for s in DEFAULT_CAPTURE_SIZES if s < largest] + [largest]


class CUDAGraphs(Runner):
    """One CUDA graph per decode batch size over the guard-free compiled step. The arguments
    named in `dynamic_dims` are batched along dimension 0: a call copies them into static
    buffers padded (with zeros) to the next captured size and replays that size's graph. The
    other arguments (a KV cache, say) are captured as they are and must be the same tensors on
    every call. Batches beyond the largest size run the compiled step without a graph.
    Outputs are views of the graph's buffers: use them before the next call, as vLLM does."""

    strategy = "cuda_graphs"

    def __init__(self, fn, device: str, dynamic_dims: dict, capture_sizes,
                 shared: CompiledGraphs | None = None):
        if device != "cuda":
            raise ConfigError(f"cuda_graphs needs a CUDA device (device={device!r}); "
                              f"on this machine use one of {list(STRATEGIES[:-1])}")
        if any(as_dims(d) != (0,) for d in dynamic_dims.values()):
            raise ConfigError("cuda_graphs pads the batch along dimension 0 only: give "
                              "dynamic_dims as {argument index: 0}")
        super().__init__(fn, device)
        self.inner = GuardFree(fn, device, dynamic_dims, shared)
        self.code = self.inner.code
        self.batched = sorted(dynamic_dims)
        self.capture_sizes = sorted(capture_sizes)
        self.graphs, self.static_out, self.pool = {}, {}, None
        self.static_args = None

    @property
    def graphs_compiled(self) -> int:
        return self.inner.graphs_compiled

    @property
    def reused_from(self) -> str | None:
        return self.inner.reused_from

    def _args_for(self, size: int) -> tuple:
        return tuple(a[:size] if i in self.batched else a for i, a in enumerate(self.static_args))

    def warm(self, example_args: tuple) -> "Runner":
        """Compile (the first call, timed into `compile_seconds`), then run each capture size
        once and capture its graph (timed into `capture_seconds`)."""
        t0 = time.perf_counter()
        self.inner(*example_args)  # compile once, batch dimension dynamic
        torch.cuda.synchronize()
        self.compile_seconds = time.perf_counter() - t0
        t0 = time.perf_counter()
        largest = self.capture_sizes[-1]
        self.static_args = tuple(
            a.new_zeros((largest,) + tuple(a.shape[1:])) if i in self.batched else a
            for i, a in enumerate(example_args))
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for size in self.capture_sizes:  # each size once outside capture (Triton's JIT)
                self.inner(*self._args_for(size))
        torch.cuda.current_stream().wait_stream(stream)
        for size in reversed(self.capture_sizes):  # largest first; the others share its pool
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.static_out[size] = self.inner(*self._args_for(size))
            self.pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - t0
        return self

    def size_for(self, batch: int) -> int | None:
        return next((s for s in self.capture_sizes if s >= batch), None)

    def __call__(self, *args):
        # With no batched argument (a decode step on its own persistent buffers), every call
        # is the one captured size.
        batch = args[self.batched[0]].shape[0] if self.batched else self.capture_sizes[-1]
        size = self.size_for(batch)
        if size is None:
            return self.inner(*args)
        for i, (arg, static) in enumerate(zip(args, self.static_args)):
            if i in self.batched:
                if arg.shape[1:] != static.shape[1:]:
                    raise ConfigError(f"cuda_graphs captured argument {i} as [batch, "
                                      f"{list(static.shape[1:])}], got {list(arg.shape)}")
                static[:batch].copy_(arg)
                static[batch:size].zero_()  # padding rows: token 0, position 0, block 0
            elif arg is not static:
                raise ConfigError(f"cuda_graphs: argument {i} must be the tensor captured")
        self.graphs[size].replay()
        out = self.static_out[size]
        return out[:batch] if torch.is_tensor(out) else type(out)(o[:batch] for o in out)

    def discard(self) -> None:
        self.graphs, self.static_out, self.pool = {}, {}, None
        self.inner.discard()


def make_runner(fn, strategy: str, device: str, example_args: tuple,
                dynamic_dims: dict | None = None, capture_sizes=None,
                inductor_config: dict | None = None,
                shared: CompiledGraphs | None = None) -> Runner:
    """`fn` run by `strategy` (one of STRATEGIES), already warm: its first call, with
    `example_args`, has compiled it (timed in `compile_seconds`; a cuda_graphs runner's captures
    in `capture_seconds`). `dynamic_dims` maps argument index -> dimensions marked dynamic
    (default: argument 0's dimension 0, the batch).
    `capture_sizes` (cuda_graphs) are the decode batch sizes captured (default: vLLM's list up
    to the example's batch size). `inductor_config` patches Inductor's settings for the first
    call, which compiles (e.g. {"freezing": True}: weights as constants, prepacked for oneDNN on
    the CPU). `shared`: graphs compiled for runners of the same model and inputs, taken
    instead of compiling again (`CompiledGraphs`)."""
    check_strategy(strategy)
    dims = DEFAULT_DYNAMIC_DIMS if dynamic_dims is None else dynamic_dims
    if strategy == "eager":
        runner = Runner(fn, device)
    elif strategy == "stock":
        runner = Compiled(fn, device, dims, shared)
    elif strategy == "guard_free":
        runner = GuardFree(fn, device, dims, shared)
    elif strategy == "bytecode_hook":
        runner = BytecodeHook(fn, device, dims, shared)
    else:
        batch = example_args[min(dims, default=0)].shape[0]
        runner = CUDAGraphs(fn, device, dims, capture_sizes or capture_sizes_up_to(batch), shared)
    # Dynamo reads some of these too (freezing: parameters become constants), so they hold
    # for the whole first call, which traces and compiles. Frozen weights packed for oneDNN
    # would keep the graph out of Inductor's cache: `packed_weights_cached` lets them in (and
    # changes nothing for a graph without them).
    with torch._inductor.config.patch(inductor_config or {}), packed_weights_cached():
        return runner.warm(tuple(example_args))
