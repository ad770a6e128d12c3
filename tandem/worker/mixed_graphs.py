"""CUDA graphs for steps that hold a prompt chunk: everything between two stateful layers
replayed from graphs, the stateful layers run eagerly between them ("piecewise" graphs).

A step with a prompt chunk cannot replay a decode graph: its attention reads chunk boundaries
and context lengths that only the host knows, per step. Run eagerly, though, the rest of the
forward pass (norms, projections, rotary, activations, residual adds: a dozen launches a layer)
costs the host more than the device needs for a small step — on one H100 a Llama-3.1-8B step of
15 decodes and a 135-token prompt chunk took 28.8 ms, the host launching, against 6.8 ms for a
decode step replaying a graph; so a scheduler that keeps decodes' inter-token gap short by
chunking prompts small (``max_itl_ms``) could not. Here a step of up to the largest captured
size replays, per segment between stateful layers, a graph captured for its token count rounded
up to a captured size, and runs each stateful layer (page writes, attention) eagerly over the
step's real tokens and metadata in between.

Capture, per size: a warm-up forward over padding tokens (every stateful layer runs, writing
nothing and reading the null page) learns each stateful layer's output; then the forward runs
under stream capture, and each stateful layer's call ends the graph being captured, is recorded
(the module's own forward, its arguments: tensors the graph just wrote) and begins the next
graph, which starts by allocating the static tensor that stands for the layer's output. A replay
copies the step's ids and positions into the static inputs, replays graph 0, calls stateful layer
0 over its recorded arguments' first ``n`` rows with the step's forward context, copies its output
into the static output, replays graph 1, and so on; the last graph's output holds the hidden
states. Rows past ``n`` are padding: their ids and positions are whatever a step left there
(valid values), their attention output stale (finite): every op outside the stateful layers is
row-wise, so they never reach a real row, and nothing reads them after.

Memory: every size's graphs share one pool. The recorded tensors are held without owning their
memory (the allocator sees them freed when the forward pass drops them, as in an eager pass), so
the pool holds about one eager forward pass of the largest size; a replay uses each address at
the same point of the pass as the capture did, and the sizes never replay interleaved.

Which models: graph-safe models (``cuda_graph_safe``) whose every stateful module declares
``mixed_graph_boundary`` (its forward takes tensors indexed by token first, the forward context,
and returns one such tensor; nothing outside it reads the context): the families built of
``Attention`` layers. ``enforce_eager`` or ``mixed_step_graphs=False`` keep them eager.

Under tensor parallelism the graphs hold the layers' collectives (the boundaries, attention over
a rank's own heads, hold none), so every rank must replay the same graphs for a step: each rank
captures the same sizes in the same order, agreeing after each size that all captured it
(``parallel/graphs.py``'s ``capture_mixed_on_every_rank``: one rank's failure leaves every rank
eager), and the choice is the step's token count, which every rank's plan carries. The input ids
rank 0 holds on its device go to every rank before the first graph, as for decode graphs. There
the default sizes go on to 4,096 tokens (``default_mixed_graph_sizes``).

Off a GPU (tests, ``TANDEM_GRAPH_BUFFERS_ON_CPU=1``) nothing is captured: a replay runs the same
forward eagerly over the static padded buffers, its stateful layers through the same argument
trimming, context substitution and output copies as a replay, so those run on a CPU.
"""
from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Optional

import torch

from tandem.layers.forward_context import ForwardContext
from tandem.worker.graph_choice import size_for
from tandem.worker.host_staging import copy_to_device

if TYPE_CHECKING:
    from tandem.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


DEFAULT_SIZES = [8, 16, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 448, 512, 640, 768, 896, 1024]
# Under tensor parallelism a rank's host launches outlast its share of the device work further
# up: at TP=2 on the Llama-3.1-8B shape, steps of 4,096 prompt tokens took 42.5-43.2 ms replayed
# against 57-84 ms eagerly (two H200s; docs/benchmarks.md).
TENSOR_PARALLEL_SIZES = DEFAULT_SIZES + [1536, 2048, 3072, 4096]


def default_mixed_graph_sizes(max_num_batched_tokens: int, tensor_parallel: bool = False) -> list[int]:
    """Token counts up to 1,024 (finer where a step is launch-bound; under tensor parallelism up
    to 4,096), the step budget last where it is smaller. Past them a step's device time hides its
    host's launches: it runs eagerly."""
    sizes = TENSOR_PARALLEL_SIZES if tensor_parallel else DEFAULT_SIZES
    return [size for size in sizes if size < max_num_batched_tokens] + (
        [max_num_batched_tokens] if max_num_batched_tokens <= sizes[-1] else [])


def stateful_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [module for module in model.modules()
            if module is not model and callable(getattr(module, "state_specs", None))]


def mixed_graphs_apply(model: torch.nn.Module) -> bool:
    """Whether every stateful module is a boundary mixed-step graphs can run eagerly."""
    modules = stateful_modules(model)
    return bool(modules) and all(getattr(module, "mixed_graph_boundary", False) for module in modules)


def non_owning(tensor: torch.Tensor) -> torch.Tensor:
    """A view of ``tensor``'s memory that does not keep it allocated (the caching allocator may
    hand it out again once the tensor's own references are gone)."""
    storage = tensor.untyped_storage()
    borrowed = torch._C._construct_storage_from_data_pointer(storage.data_ptr(), tensor.device, storage.nbytes())
    return torch.empty((0,), dtype=tensor.dtype, device=tensor.device).set_(
        borrowed, tensor.storage_offset(), tensor.size(), tensor.stride())


@dataclass
class BoundaryCall:
    """One stateful layer's call as captured: its forward, its arguments (tensors the graph
    before it wrote, the capture's forward context) and the static tensor its output goes to."""
    forward: Callable
    args: tuple
    kwargs: dict
    out: Optional[torch.Tensor] = None  # None off a GPU until the first replay allocates it

    def run(self, size: int, count: int, context: ForwardContext) -> torch.Tensor:
        """The layer over the step's ``count`` real rows with the step's context; its output
        copied into the static tensor's first rows (allocated here off a GPU)."""
        trim = lambda value: (context if isinstance(value, ForwardContext) else
                              value[:count] if isinstance(value, torch.Tensor) and value.dim() and
                              value.shape[0] == size else value)
        result = self.forward(*[trim(value) for value in self.args],
                              **{name: trim(value) for name, value in self.kwargs.items()})
        if self.out is None:
            self.out = result.new_zeros((size,) + tuple(result.shape[1:]))
        self.out[:count].copy_(result)
        return self.out


@dataclass
class SizeGraphs:
    """What one size replays: ``len(calls) + 1`` graphs with the calls between them."""
    size: int
    graphs: list = field(default_factory=list)
    calls: list[BoundaryCall] = field(default_factory=list)
    hidden: Optional[torch.Tensor] = None  # the last graph's output [size, hidden]


class MixedStepGraphs:
    """Owner of the mixed-step graphs of one model runner (target model, one rank)."""

    def __init__(self, runner: "ModelRunner", token_sizes: list[int]) -> None:
        self.runner = runner
        self.token_sizes = sorted(set(token_sizes))
        largest = self.token_sizes[-1]
        self.input_ids = torch.zeros(largest, dtype=torch.long, device=runner.device)
        self.positions = torch.zeros(largest, dtype=torch.long, device=runner.device)
        self.stateful = stateful_modules(runner.model)
        self.sizes: dict[int, SizeGraphs] = {}
        self.pool = None
        self.captured = False
        self.num_replays = 0

    def fits(self, num_tokens: int) -> bool:
        return 0 < num_tokens <= self.token_sizes[-1]

    @contextlib.contextmanager
    def _boundaries(self, handler: Callable):
        """Every stateful module's calls go to ``handler(module_forward, *args, **kwargs)``."""
        for module in self.stateful:
            original = module.forward
            module.forward = lambda *args, _original=original, **kwargs: handler(_original, *args, **kwargs)
        try:
            yield
        finally:
            for module in self.stateful:
                del module.forward  # the class's forward again

    @torch.inference_mode()
    def capture(self, agree: Optional[Callable[[bool], bool]] = None) -> None:
        """Capture every size, largest first (the smaller reuse the pool's memory). Under tensor
        parallelism ``agree(captured)`` is a collective after each size, true when every rank
        captured it: otherwise every rank stops there (raises), so none goes on to the next size's
        warm-up pass, whose collectives run, while another has given up."""
        started = time.perf_counter()
        self.pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.token_sizes):
            failure = None
            try:
                self.sizes[size] = self._capture(size)
            except Exception as error:  # (raised below, once the other ranks know)
                if agree is None:
                    raise
                failure = error
            if agree is not None and not agree(failure is None):
                raise failure or RuntimeError(f"another rank could not capture the mixed-step graphs of {size} tokens")
        torch.cuda.synchronize(self.runner.device)
        self.captured = True
        logger.info("captured mixed-step CUDA graphs for %s tokens in %.1f s (%d stateful layers run eagerly "
                    "between them)", self.token_sizes, time.perf_counter() - started,
                    len(self.sizes[self.token_sizes[-1]].calls))

    def _capture(self, size: int) -> SizeGraphs:
        runner = self.runner
        context = runner.forward_context(runner.padding_metadata(size))
        ids, positions = self.input_ids[:size], self.positions[:size]
        outputs: list[tuple[torch.Size, torch.dtype]] = []

        def warm(forward, *args, **kwargs):
            result = forward(*args, **kwargs)
            outputs.append((result.shape, result.dtype))
            return result

        with self._boundaries(warm):  # kernels compile, output shapes are learnt
            runner.model(ids, positions, context)
        torch.cuda.synchronize(runner.device)
        recorded = SizeGraphs(size)
        stream = torch.cuda.Stream(runner.device)
        stream.wait_stream(torch.cuda.current_stream(runner.device))
        graph = torch.cuda.CUDAGraph()

        def cut(forward, *args, **kwargs):
            nonlocal graph
            graph.capture_end()
            recorded.graphs.append(graph)
            shape, dtype = outputs[len(recorded.calls)]
            graph = torch.cuda.CUDAGraph()
            graph.capture_begin(pool=self.pool)
            out = torch.empty(shape, dtype=dtype, device=runner.device)
            weak = lambda value: non_owning(value) if isinstance(value, torch.Tensor) else value
            recorded.calls.append(BoundaryCall(forward, tuple(weak(value) for value in args),
                                               {name: weak(value) for name, value in kwargs.items()}, non_owning(out)))
            return out

        with torch.cuda.stream(stream):
            graph.capture_begin(pool=self.pool)
            try:
                with self._boundaries(cut):
                    recorded.hidden = runner.model(ids, positions, context)
            finally:
                graph.capture_end()
            recorded.graphs.append(graph)
        torch.cuda.current_stream(runner.device).wait_stream(stream)
        return recorded

    def release(self) -> None:
        if self.captured:
            torch.cuda.synchronize(self.runner.device)
        self.sizes.clear()
        self.pool = None
        self.captured = False

    def replay(self, input_ids, positions, context: ForwardContext, feed=None,
               broadcast_inputs: bool = False) -> torch.Tensor:
        """The hidden states ``[n, hidden]`` of a step of ``n`` tokens (``input_ids`` and
        ``positions``: host arrays; ``feed`` writes pending input tokens into the static ids;
        ``broadcast_inputs``: rank 0's static ids then go to every rank, an eager collective
        before the first graph): a view of a static buffer, valid until the next replay."""
        count = len(input_ids)
        size = size_for(self.token_sizes, count)
        copy_to_device(self.input_ids[:count], input_ids)
        copy_to_device(self.positions[:count], positions)
        if feed is not None:
            feed(self.input_ids[:count])
        if broadcast_inputs:
            self.runner.model.tensor_shard.broadcast(self.input_ids[:count])
        self.num_replays += 1
        if not self.captured:  # off a GPU: the same forward, eagerly, over the static buffers
            calls = self.sizes.setdefault(size, SizeGraphs(size)).calls
            position = iter(range(1 << 30))

            def emulate(forward, *args, **kwargs):
                index = next(position)
                if index == len(calls):
                    calls.append(BoundaryCall(forward, (), {}))
                call = calls[index]
                call.forward, call.args, call.kwargs = forward, args, kwargs
                return call.run(size, count, context)

            with self._boundaries(emulate):
                hidden = self.runner.model(self.input_ids[:size], self.positions[:size], context)
            return hidden[:count]
        recorded = self.sizes[size]
        for graph, call in zip(recorded.graphs, recorded.calls + [None]):
            graph.replay()
            if call is not None:
                call.run(size, count, context)
        return recorded.hidden[:count]

