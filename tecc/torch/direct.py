"""A later process's graph without AOTAutograd (part of the option `aot_cache`).

A hit of AOTAutograd's cache (aot_cache.py) skips the joint trace and the partitioner, but a new
process still pays for AOTAutograd's front end before the lookup: every parameter made a fake
tensor, and the cache key, which hashes triton's sources and imports inductor's code generators
(~1 s of a GPT-2 small second process on an H200 host, benchmarks/RESULTS.md). For a graph where
AOTAutograd's runtime only calls the forward, saves tensors for the backward and calls the
backward, tecc keeps what that runtime needs beside the two graphs' keys in its disk cache,
under a key of the dynamo graph, and a later process builds the autograd function itself:

- eligible (`key` gives None otherwise): static sizes, plain tensor inputs none of which is
  passed twice, no parameters or constants held by the dynamo graph, only function and method
  calls in it;
- recorded (`Recorder`, at the first compile) only when AOTAutograd's metadata of the graph
  (`TracingContext.fw_metadata`) shows no mutated input, no output aliasing an input or
  another output, no intermediate base, no tensor subclass, no effect tokens, no RNG state
  handed between the graphs, and the two graphs agree with it (the forward returns the user's
  outputs then the saved tensors; the backward takes the saved tensors then one tangent per
  differentiable output, and returns a gradient per input);
- the runtime (`load`): a `torch.autograd.Function` whose forward runs the forward graph with
  autocast off (as AOTAutograd runs compiled graphs), saves the tensors and marks the outputs
  that take no gradient; its backward releases the saved tensors to the backward graph (which
  frees each after its last reader, as under AOTAutograd), with each tangent given the strides
  the backward was compiled for; an inference graph is called as it is.

The key holds the dynamo graph's code, each input's type, shape, strides, dtype, device and
`requires_grad`, the grad mode, the autocast state, the deterministic flag, torch's version and
tecc's identity (aot_cache.identity: its sources, the options, the GPU). A missing, damaged or
stale entry, or a graph the disk cache no longer holds, is a miss: the backend goes through
AOTAutograd as without it (and records anew). Double backward is refused, as under AOTAutograd.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch
from torch.fx import GraphModule

from ..compiler import options as knobs
from ..runtime.artifact import write_atomically

log = logging.getLogger("tecc.torch")

FORMAT = 1
SUBDIR = "direct"
# what happened in this process: entries used and written, and the last reason one was not
STATS: dict[str, Any] = {"hits": 0, "stored": 0, "not_recorded": ""}


def key(gm: GraphModule, example_inputs: Sequence[Any], identity: str) -> str | None:
    """The entry's key for the dynamo graph `gm` and its inputs, or None where it is not eligible."""
    if any(node.op not in ("placeholder", "call_function", "call_method", "output") for node in gm.graph.nodes):
        return None
    if next(iter(gm.parameters()), None) is not None or next(iter(gm.buffers()), None) is not None:
        return None
    inputs = []
    for x in example_inputs:
        if type(x) not in (torch.Tensor, torch.nn.Parameter) or any(isinstance(d, torch.SymInt) for d in x.shape):
            return None
        inputs.append([type(x).__name__, list(x.shape), list(x.stride()), x.storage_offset(), str(x.dtype),
                       str(x.device), x.requires_grad])
    if len({id(x) for x in example_inputs}) != len(example_inputs):
        return None
    autocast = {device: [torch.is_autocast_enabled(device), str(torch.get_autocast_dtype(device))]
                for device in ("cpu", "cuda")}
    fields = {"format": FORMAT, "code": gm.code, "inputs": inputs, "grad": torch.is_grad_enabled(),
              "autocast": autocast, "deterministic": torch.are_deterministic_algorithms_enabled(),
              "torch": torch.__version__, "tecc": identity}
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()


def _path(entry_key: str) -> Path:
    return knobs.cache_dir() / SUBDIR / entry_key[:2] / f"{entry_key}.json"


@dataclass
class Recorder:
    """What the two compiles of one `aot_module_simplified` call leave for the entry (module
    docstring); `refused` says why there will be none."""

    inputs: int
    graphs: dict[str, dict[str, Any]] = field(default_factory=dict)
    refused: str = ""

    def note(self, kind: str, gm: GraphModule) -> None:
        """Note the graph AOTAutograd hands the compiler `kind` (before the compile changes it)."""
        if self.refused:
            return
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        output = next(n for n in gm.graph.nodes if n.op == "output").args[0]
        outputs = list(output) if isinstance(output, (list, tuple)) else [output]
        noted: dict[str, Any] = {"placeholders": len(placeholders), "outputs": len(outputs)}
        if kind in ("forward", "inference"):
            meta = _fw_metadata()
            refusal = _refusal(meta)
            if not refusal and not all(isinstance(_val(n), torch.Tensor) for n in outputs):
                refusal = f"the {kind} graph returns a value that is not a tensor"
            if refusal:
                self.refused = refusal
                return
            noted["differentiable"] = [bool(o.requires_grad) for o in meta.output_info]
        else:
            if not all(isinstance(_val(n), torch.Tensor) for n in placeholders):
                self.refused = "the backward graph takes a value that is not a tensor"
                return
            tangents = [_val(n) for n in placeholders if n.name.startswith("tangents")]
            noted["tangents"] = [[list(v.shape), list(v.stride())] for v in tangents]
        self.graphs[kind] = noted

    def keyed(self, kind: str, graph_key: str | None) -> None:
        """tecc's disk-cache key of the graph noted for `kind` (None: not in the disk cache)."""
        if self.refused:
            return
        if graph_key is None:
            self.refused = f"the {kind} graph is not in tecc's disk cache"
            return
        self.graphs[kind]["key"] = graph_key

    def entry(self) -> dict[str, Any] | None:
        """The entry, or None (and `refused` says why) where the graphs do not fit the runtime."""
        if self.refused:
            return None
        if "inference" in self.graphs and len(self.graphs) == 1:
            fw = self.graphs["inference"]
            if fw["placeholders"] != self.inputs or fw["outputs"] != len(fw["differentiable"]):
                self.refused = "the inference graph's inputs or outputs are not the dynamo graph's"
                return None
            return {"format": FORMAT, "kind": "inference", "forward": fw["key"], "outputs": fw["outputs"]}
        if set(self.graphs) != {"forward", "backward"}:
            self.refused = f"compiled graphs {sorted(self.graphs)}, not a forward and a backward"
            return None
        fw, bw = self.graphs["forward"], self.graphs["backward"]
        outputs = len(fw["differentiable"])
        saved = fw["outputs"] - outputs
        tangents = bw["tangents"]
        if (fw["placeholders"] != self.inputs or saved < 0 or bw["placeholders"] != saved + len(tangents)
                or len(tangents) != sum(fw["differentiable"]) or bw["outputs"] != self.inputs):
            self.refused = "the forward and backward graphs do not agree with AOTAutograd's metadata"
            return None
        return {"format": FORMAT, "kind": "training", "forward": fw["key"], "backward": bw["key"],
                "outputs": outputs, "differentiable": fw["differentiable"], "tangents": tangents}

    def save(self, entry_key: str) -> bool:
        entry = self.entry()
        if entry is None:
            STATS["not_recorded"] = self.refused
            log.info("tecc: no direct entry for this graph (%s)", self.refused)
            return False
        path = _path(entry_key)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomically(path, json.dumps(entry).encode())
        except OSError as e:
            log.info("tecc: direct entry not written (%s)", e)
            return False
        STATS["stored"] += 1
        return True


def _val(node: Any) -> Any:
    return node.meta.get("val") if hasattr(node, "meta") else None


def _fw_metadata() -> Any:
    from torch._guards import TracingContext

    context = TracingContext.try_get()
    return getattr(context, "fw_metadata", None)


def _refusal(meta: Any) -> str:
    """Why AOTAutograd's runtime does more for this graph than the direct one does ('' if not)."""
    if meta is None:
        return "AOTAutograd left no metadata of the graph"
    try:
        checks = [
            (meta.num_mutated_inp_runtime_indices == 0
             and not any(i.mutates_data or i.mutates_metadata for i in meta.input_info), "an input is mutated"),
            (meta.num_outputs_aliased == 0 and meta.num_intermediate_bases == 0
             and all(o.output_type.name == "non_alias" for o in meta.output_info),
             "an output aliases an input or another output"),
            (meta.num_forward_returns == meta.num_outputs, "the forward returns more than the user's outputs"),
            (not meta.is_rng_op_functionalized and not meta.tokens and not getattr(meta, "num_backward_tokens", 0)
             and not getattr(meta, "num_graphsafe_rng_states", 0), "RNG state or effect tokens"),
            (not any(type(m).__name__ == "SubclassCreationMeta"
                     for m in [*meta.subclass_inp_meta, *meta.subclass_fw_graph_out_meta,
                               *meta.subclass_tangent_meta]), "a tensor subclass"),
            (getattr(meta, "grad_enabled_mutation", None) is None, "the graph changes the grad mode"),
            (not getattr(meta, "num_tensors_saved_with_no_vc_check", 0), "tensors saved without version checks"),
        ]
    except AttributeError as e:  # a torch whose metadata lacks a field used here
        return f"AOTAutograd's metadata has no {e.name if hasattr(e, 'name') else e}"
    return next((why for ok, why in checks if not ok), "")


# ---- the runtime -------------------------------------------------------------------------------
@contextlib.contextmanager
def _autocast_off() -> Iterator[None]:
    """Autocast off around a compiled graph, as AOTAutograd runs them (the graphs' dtypes are
    decided; a fallback ATen op must not be cast again)."""
    disable = getattr(torch._C, "_DisableAutocast", None)
    if disable is not None:
        with disable():
            yield
    else:  # pragma: no cover - every torch the backend supports has it
        with torch.autocast("cpu", enabled=False), torch.autocast("cuda", enabled=False):
            yield


def load(entry_key: str, loader: Callable[[str, str], Any], name: str) -> Callable[..., Any] | None:
    """The graph's callable from its entry (`loader(graph key, graph name)` loads a compiled
    graph from the disk cache, None on a miss), or None: no entry, a damaged or stale one, or a
    graph the disk cache no longer holds."""
    try:
        entry = json.loads(_path(entry_key).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(entry, dict) or entry.get("format") != FORMAT:
        return None
    try:
        forward = loader(entry["forward"], f"{name}_{'inference' if entry['kind'] == 'inference' else 'forward'}")
        if forward is None:
            return None
        if entry["kind"] == "inference":
            made = _inference(forward, int(entry["outputs"]))
        else:
            backward = loader(entry["backward"], f"{name}_backward")
            if backward is None:
                return None
            made = _training(forward, backward, int(entry["outputs"]), [bool(d) for d in entry["differentiable"]],
                             [(tuple(s), tuple(t)) for s, t in entry["tangents"]])
    except (KeyError, TypeError, ValueError) as e:
        log.info("tecc: direct entry %s unusable (%s)", entry_key[:12], e)
        return None
    STATS["hits"] += 1
    return made


def _inference(forward: Callable[[list[Any]], Any], outputs: int) -> Callable[..., Any]:
    def run(*args: Any) -> list[Any]:
        with _autocast_off():
            return list(forward(list(args))[:outputs])

    return run


def _training(forward: Callable[[list[Any]], Any], backward: Callable[[list[Any]], Any], outputs: int,
              differentiable: list[bool], tangents: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> Callable[..., Any]:
    class CompiledGraphFunction(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, *args: Any) -> Any:  # type: ignore[override]
            with _autocast_off():
                outs = list(forward(list(args)))
            user, saved = outs[:outputs], outs[outputs:]
            ctx.save_for_backward(*saved)
            fixed = [o for o, d in zip(user, differentiable) if not d]
            if fixed:
                ctx.mark_non_differentiable(*fixed)
            return tuple(user)

        @staticmethod
        def backward(ctx: Any, *grads: Any) -> Any:  # type: ignore[override]
            if torch.is_grad_enabled():
                raise RuntimeError("tecc: a compiled graph's backward cannot be differentiated again "
                                   "(double backward is not supported, as with AOTAutograd)")
            # the boxed list is the only holder of the saved tensors the backward graph is given
            # (it clears the list and frees each after its last reader, as under AOTAutograd)
            args = list(ctx.saved_tensors)
            if hasattr(ctx, "maybe_clear_saved_tensors"):
                ctx.maybe_clear_saved_tensors()
            given = [g for g, d in zip(grads, differentiable) if d]
            args += [_strided(g, shape, strides) for g, (shape, strides) in zip(given, tangents)]
            with _autocast_off():
                return tuple(backward(args))

    def run(*args: Any) -> list[Any]:
        return list(CompiledGraphFunction.apply(*args))

    return run


def _strided(g: torch.Tensor, shape: tuple[int, ...], strides: tuple[int, ...]) -> torch.Tensor:
    """The tangent with the strides the backward graph was compiled for (a copy only if it has others)."""
    if tuple(g.shape) != shape or g.numel() <= 1 or tuple(g.stride()) == strides:
        return g
    out = torch.empty_strided(shape, strides, dtype=g.dtype, device=g.device)
    out.copy_(g)
    return out
