"""AOTAutograd's own cache for the tecc backend (option `aot_cache`): a second process skips
AOTAutograd's joint trace and its partitioner.

Without it every new process re-traces the model's joint graph and re-runs the min-cut
partitioner before the backend sees a graph (3-4 s for GPT-2 small's 12 layers on a CPU), even
when tecc's disk cache (cache.py) holds every compiled graph. torch's AOTAutogradCache
(torch/_functorch/_aot_autograd/autograd_cache.py), which inductor uses, keeps the result of
AOTAutograd (its runtime wrappers' metadata and the compiled forward and backward) keyed by the
dynamo graph, its inputs and the configurations; on a hit it rebuilds the autograd function
without tracing. It engages for any backend whose forward compiler is a
`SerializableAOTDispatchCompiler` returning an `OutputCode`, and stores that output code itself
(pickled) when `bundled_autograd_cache` is on. Here:

- the compilers return a `TeccOutputCode`: the compiled graph, and what a later process needs to
  get it back: tecc's graph key (cache.graph_key) and the ATen graph, pickled by torch's
  GraphPickler (node values as fake tensors) when the graph has lifted constants or tecc's disk
  cache does not hold it (the emulator's graphs);
- on a hit (`post_compile`) the graph is loaded from tecc's disk cache by the stored key, with
  no ATen graph read; a missing or damaged tecc entry compiles the stored ATen graph again (no
  trace, no partition; the compile stores the entry anew); an ATen graph that cannot be read
  back raises torch's FXGraphCacheMiss, which torch counts as a miss: it traces, partitions and
  compiles as without the option, and replaces the entry;
- torch's key knows nothing of the backend (not its compiler, its partitioner nor its
  decompositions): tecc's identity (its sources' fingerprint, the options, the GPU) enters it as
  the uuid of a no-op inductor custom pass (`post_grad_custom_post_pass`, part of the key,
  never run: inductor does not compile these graphs) set around the call, so a tecc version or
  option change, or inductor's entry for the same model, is a different key.

The cache lives where torch keeps it (TORCHINDUCTOR_CACHE_DIR/aotautograd); `TECC_NO_CACHE=1`
turns the option off with tecc's other caches, torch's `force_disable_caches` with torch's.
`available()` is False (and the backend compiles as without the option, silently) when this
torch lacks any of the names used.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
from typing import Any, Callable, Iterator, Sequence

import torch
from torch.fx import GraphModule

log = logging.getLogger("tecc.torch")


def available() -> bool:
    """Whether this torch has every piece the option uses (checked once)."""
    global _AVAILABLE
    if _AVAILABLE is None:
        try:
            _imports()
            from torch._functorch import config

            _AVAILABLE = all(hasattr(config, name) for name in ("bundled_autograd_cache", "enable_autograd_cache"))
        except (ImportError, AttributeError):
            _AVAILABLE = False
    return _AVAILABLE


_AVAILABLE: bool | None = None


def _imports() -> tuple[Any, ...]:
    from torch._functorch._aot_autograd.autograd_cache import FXGraphCacheMiss
    from torch._functorch._aot_autograd.schemas import SerializableAOTDispatchCompiler
    from torch._inductor import config as inductor_config
    from torch._inductor.custom_graph_pass import CustomGraphPass
    from torch._inductor.output_code import OutputCode
    from torch.fx._graph_pickler import GraphPickler

    if not hasattr(inductor_config, "post_grad_custom_post_pass"):
        raise AttributeError("post_grad_custom_post_pass")
    return FXGraphCacheMiss, SerializableAOTDispatchCompiler, CustomGraphPass, OutputCode, GraphPickler


def identity(options: dict[str, Any]) -> str:
    """What torch's key must tell apart for tecc: its sources, the options, the GPU."""
    from ..compiler import options as knobs
    from ..compiler.build_cache import source_fingerprint

    device = ""
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        device = f"{torch.cuda.get_device_name()} sm_{major}{minor}"
    fields = {"backend": "tecc", "tecc": source_fingerprint(), "options": options, "device": device,
              "arch": knobs.default_arch_override()}
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()


@contextlib.contextmanager
def engaged(uuid: str) -> Iterator[None]:
    """AOTAutograd's cache on, bundled (the output code pickled into the entry), and tecc's
    identity (`identity(options)`) in its key, for one `aot_module_simplified` call."""
    from torch._functorch import config
    from torch._inductor import config as inductor_config

    _, _, CustomGraphPass, _, _ = _imports()

    class TeccKey(CustomGraphPass):  # type: ignore[misc, valid-type]
        """Never run: its uuid puts tecc's identity into torch's key."""

        def __call__(self, graph: Any) -> None:
            return None

        def uuid(self) -> str:
            return uuid

    # the backward compiled with the forward, not at the first backward call: the entry is saved
    # once both are compiled, and it is saved bundled only while the patch holds
    eager = {"force_non_lazy_backward_lowering": True} if hasattr(config, "force_non_lazy_backward_lowering") else {}
    with config.patch(bundled_autograd_cache=True, enable_autograd_cache=True, **eager), \
            inductor_config.patch(post_grad_custom_post_pass=TeccKey()):
        yield


# the backend's loaders, set by tecc.torch.backend when it is imported (it imports this module;
# this module importing it back would be a circle): compile_graph and from_disk_cache
_BACKEND: dict[str, Callable[..., Any]] = {}


def connect(compile_graph: Callable[..., Any], from_disk_cache: Callable[..., Any]) -> None:
    """Give TeccOutputCode.post_compile the backend's loaders (called once by tecc.torch.backend)."""
    _BACKEND.update(compile_graph=compile_graph, from_disk_cache=from_disk_cache)


def serializable(compile_fn: Callable[[GraphModule, Sequence[Any]], Any]) -> Any:
    """The compiler as AOTAutograd's cache wants it (a SerializableAOTDispatchCompiler)."""
    _, SerializableAOTDispatchCompiler, _, _, _ = _imports()
    return SerializableAOTDispatchCompiler(TeccOutputCode, compile_fn)


def _output_code_base() -> type:
    try:
        return _imports()[3]  # type: ignore[no-any-return]
    except (ImportError, AttributeError):
        return object


class TeccOutputCode(_output_code_base()):  # type: ignore[misc]
    """A compiled graph as AOTAutograd's cache stores it (module docstring). Pickled: the
    options, the graph's name, tecc's graph key (None: not in tecc's disk cache), and the ATen
    graph's GraphPickler bytes (None when the key is enough)."""

    def __init__(self, fn: Callable[[list[Any]], Any], options: Any, name: str, key: str | None,
                 graph: bytes | None) -> None:
        self._fx_graph_cache_key = None
        self._fx_graph_cache_debug_lines = None
        self._time_taken_ns = 0  # torch adds it up (the time a hit saves): set by the compile
        self._boxed_call = True  # an instance attribute: torch._dynamo.disable's wrapper copies __dict__
        self.fn: Callable[[list[Any]], Any] | None = fn
        self.options, self.name, self.key, self.graph = options, name, key, graph

    def __call__(self, inputs: Sequence[Any]) -> Any:
        assert self.fn is not None, f"tecc: graph {self.name} used before it was loaded"
        return self.fn(inputs)  # type: ignore[arg-type]

    def prepare_for_serialization(self) -> None:
        self.fn = None

    def set_triton_bundle(self, triton_bundle: Any) -> None:
        return None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "fn": None}

    def post_compile(self, example_inputs: Sequence[Any], constants: Any, graph_kwargs: Any) -> None:
        """The compiled graph back (a cache hit): from tecc's disk cache by the key, else compiled
        from the stored ATen graph, else torch's FXGraphCacheMiss (torch then traces afresh)."""
        if self.fn is not None:
            return
        assert _BACKEND, "tecc.torch.backend connects its loaders when it is imported"
        compile_graph, from_disk_cache = _BACKEND["compile_graph"], _BACKEND["from_disk_cache"]
        FXGraphCacheMiss = _imports()[0]

        if self.key is not None:  # no constants to lift: the key is enough
            self.fn = from_disk_cache(self.key, self.options, self.name, [])
            if self.fn is not None:
                return
            raise FXGraphCacheMiss(f"tecc: graph {self.name} is not in tecc's disk cache (missing or damaged)")
        gm = self._graph()
        self.fn = compile_graph(gm, [], self.options, self.name)

    def _graph(self) -> GraphModule:
        FXGraphCacheMiss, _, _, _, GraphPickler = _imports()
        if self.graph is None:
            raise FXGraphCacheMiss(f"tecc: graph {self.name} is not in tecc's disk cache and its ATen graph "
                                   "was not stored")
        try:
            from torch._guards import detect_fake_mode
            from torch._subclasses.fake_tensor import FakeTensorMode
            from torch.fx.experimental.symbolic_shapes import ShapeEnv

            mode = detect_fake_mode() or FakeTensorMode(shape_env=ShapeEnv())
            gm = GraphPickler.loads(self.graph, mode)
        except Exception as e:  # noqa: BLE001 - any failure to read it back is a miss
            raise FXGraphCacheMiss(f"tecc: the stored ATen graph of {self.name} cannot be read: {e}") from e
        if not isinstance(gm, GraphModule):
            raise FXGraphCacheMiss(f"tecc: the stored ATen graph of {self.name} is not a graph")
        return gm


def dump_graph(gm: GraphModule) -> bytes | None:
    """The ATen graph's GraphPickler bytes (node values as fake tensors), or None when it
    cannot be pickled (then a later process traces again)."""
    _, _, _, _, GraphPickler = _imports()
    try:
        return GraphPickler.dumps(gm)  # type: ignore[no-any-return]
    except Exception as e:  # noqa: BLE001
        log.info("tecc: an ATen graph not stored for AOTAutograd's cache (%s)", e)
        return None
