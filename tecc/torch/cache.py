"""Compiled graphs on disk: a second process skips lowering, planning and code generation.

A compiled graph is its launch list (runtime.py) and its programs' kernels. Keyed by the ATen
graph (its code and every node's shape, dtype, strides and device), the backend's options, the
target and GPU (architecture and device name), and the versions (tecc's sources, torch, NVRTC),
an entry holds each program as a saved artifact (`kernel.save`: cubin, manifest, loop IR, run
with the runtime alone; docs/runtime.md) and the launch list as JSON (`graph.json`):

    TECC_CACHE_DIR/graphs/v2/<key[:2]>/<key>/graph.json, p0.cubin, p0.json, p0.ir, ...

The ATen calls of fallbacks are stored by their op's name and resolved in the loading process;
an argument this format cannot write (an object that is not a tensor slot, a size, a number,
a string, a dtype, a device, a layout or a memory format, or nested lists of them) leaves the
graph uncached. Programs built for the emulator (CPU tensors) have no cubin and are not cached
here (the build cache keeps their plans, docs/cache.md). `TECC_NO_CACHE=1` or
`TECC_BUILD_CACHE=0` turn this cache off with the others. A damaged entry is a miss, and the
compile that follows replaces it.

A hit needs the runtime alone (`tecc.runtime.artifact.load`, the launch list's steps) and the
compiler's options and version strings for the key: loading imports none of the compiler's
pipeline (docs/models.md, "A second process").
"""

from __future__ import annotations

import hashlib
import json
import math
import operator
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch.fx import GraphModule

from ..compiler import options as knobs
from ..compiler.build_cache import source_fingerprint
from ..compiler.cache import nvrtc_version
from ..ir.expr import Expr
from ..ir.serialize import VarTable, expr_from_json, expr_to_json
from ..runtime.artifact import load
from .report import GraphReport
from .runtime import CompiledGraph, MakeView, RunAten, RunProgram, Size, Slot

FORMAT = 2
SUBDIR = f"graphs/v{FORMAT}"


class NotCacheable(Exception):
    """The graph holds something graph.json cannot write; it is compiled, not cached."""


def enabled() -> bool:
    return knobs.build_cache_enabled()


def graph_key(gm: GraphModule, options: dict[str, Any], target: str) -> str:
    """The hex SHA-256 naming a graph's entry (module docstring)."""
    nodes = [[node.name, _value_key(node.meta.get("val"))] for node in gm.graph.nodes]
    device = ""
    if target == "cuda" and torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        device = f"{torch.cuda.get_device_name()} sm_{major}{minor}"
    fields = {"format": FORMAT, "code": gm.code, "nodes": nodes, "options": options, "target": target,
              "device": device, "arch": knobs.default_arch_override(), "tecc": source_fingerprint(),
              "torch": torch.__version__, "nvrtc": nvrtc_version() if target == "cuda" else ""}
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()


def _value_key(val: Any) -> Any:
    """What the key holds of a node's value: a tensor's shape, dtype, strides and device, and a
    tuple or list of them element by element (not its repr: printing a fake tensor costs ~0.2 ms,
    and a GPT's backward graph has hundreds of multi-output nodes)."""
    if isinstance(val, torch.Tensor):
        return [str(tuple(val.shape)), str(val.dtype), str(val.stride()), str(val.device)]
    if isinstance(val, (list, tuple)):
        return {type(val).__name__: [_value_key(v) for v in val]}
    return repr(val)


def entry_dir(key: str) -> Path:
    return knobs.cache_dir() / SUBDIR / key[:2] / key


# ---- values ------------------------------------------------------------------------------------
def _encode(value: Any, vars_: VarTable) -> Any:
    if isinstance(value, Slot):
        return {"slot": value.index}
    if isinstance(value, Size):
        return {"size": expr_to_json(value.expr)}
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"float": repr(value)}
    if isinstance(value, list):
        return {"list": [_encode(v, vars_) for v in value]}
    if isinstance(value, tuple):
        return {"tuple": [_encode(v, vars_) for v in value]}
    if isinstance(value, dict):
        return {"dict": {str(k): _encode(v, vars_) for k, v in value.items()}}
    for kind in (torch.dtype, torch.layout, torch.memory_format):
        if isinstance(value, kind):
            return {kind.__name__: str(value).replace("torch.", "")}
    if isinstance(value, torch.device):
        return {"device": str(value)}
    raise NotCacheable(f"{type(value).__name__} {value!r}")


def _decode(value: Any, vars_: VarTable) -> Any:
    if not isinstance(value, dict):
        return value
    (kind, inner), = value.items()
    if kind == "slot":
        return Slot(int(inner))
    if kind == "size":
        return Size(expr_from_json(inner, vars_))
    if kind == "float":
        return float(inner)
    if kind == "list":
        return [_decode(v, vars_) for v in inner]
    if kind == "tuple":
        return tuple(_decode(v, vars_) for v in inner)
    if kind == "dict":
        return {k: _decode(v, vars_) for k, v in inner.items()}
    if kind == "device":
        return torch.device(inner)
    return getattr(torch, inner)  # dtype, layout, memory_format


_PYTHON: dict[str, Callable[..., Any]] = {"operator.getitem": operator.getitem, "torch.zeros": torch.zeros}


def _fn_name(fn: Any) -> str:
    if isinstance(fn, torch._ops.OpOverload):
        return f"op:{fn.namespace}::{fn._schema.name.split('::')[-1]}.{fn._overloadname}"
    for name, known in _PYTHON.items():
        if fn is known:
            return name
    raise NotCacheable(f"the callable {fn!r}")


def _fn(name: str) -> Callable[..., Any]:
    if name.startswith("op:"):
        qualified, _, overload = name[3:].rpartition(".")
        namespace, _, op = qualified.partition("::")
        return getattr(getattr(getattr(torch.ops, namespace), op), overload)  # type: ignore[no-any-return]
    return _PYTHON[name]


# ---- the launch list ---------------------------------------------------------------------------
def _steps_json(compiled: CompiledGraph, vars_: VarTable) -> list[dict[str, Any]]:
    steps = []
    programs = 0
    for step in compiled.steps:
        if isinstance(step, RunProgram):
            steps.append({"kind": "program", "artifact": f"p{programs}", "inputs": list(step.inputs),
                          "contiguous": list(step.contiguous), "name": step.name, "emulate": step.emulate,
                          "outputs": [[slot, _encode([Size(x) if isinstance(x, Expr) else x for x in shape], vars_),
                                       str(dtype).replace("torch.", "")]
                                      for slot, shape, dtype in step.outputs],
                          "carriers": [expr_to_json(v) for v in step.carriers], "device": str(step.device),
                          "input_orders": [None if o is None else list(o) for o in step.input_orders],
                          "output_orders": [None if o is None else list(o) for o in step.output_orders]})
            programs += 1
        elif isinstance(step, RunAten):
            steps.append({"kind": "aten", "fn": _fn_name(step.fn), "args": _encode(step.args, vars_),
                          "kwargs": _encode(step.kwargs, vars_), "output": step.output, "name": step.name})
        else:
            steps.append({"kind": "view", "base": step.base, "output": step.output, "name": step.name,
                          "chain": [[_fn_name(fn), _encode(a, vars_), _encode(k, vars_)] for fn, a, k in step.chain]})
    return steps


def _shape_value(v: Any) -> Any:
    return v.expr if isinstance(v, Size) else v


def _steps_from(doc: list[dict[str, Any]], kernels: dict[str, Any], vars_: VarTable) -> list[Any]:
    steps: list[Any] = []
    for s in doc:
        if s["kind"] == "program":
            outputs = tuple((int(slot), tuple(_shape_value(x) for x in _decode(shape, vars_)), getattr(torch, dtype))
                            for slot, shape, dtype in s["outputs"])
            carriers = tuple(expr_from_json(c, vars_) for c in s["carriers"])
            orders = [tuple(None if o is None else tuple(o) for o in s[k]) for k in ("input_orders", "output_orders")]
            steps.append(RunProgram(kernels[s["artifact"]], tuple(s["inputs"]), tuple(s["contiguous"]), outputs,
                                    bool(s["emulate"]), s["name"], carriers, torch.device(s["device"]), *orders))
        elif s["kind"] == "aten":
            steps.append(RunAten(_fn(s["fn"]), _decode(s["args"], vars_), _decode(s["kwargs"], vars_), s["output"],
                                 s["name"]))
        else:
            chain = tuple((_fn(f), _decode(a, vars_), _decode(k, vars_)) for f, a, k in s["chain"])
            steps.append(MakeView(s["base"], chain, s["output"], s["name"]))
    return steps


def store(key: str, compiled: CompiledGraph, kernels: Sequence[Any], report: GraphReport) -> Path | None:
    """Write the entry (atomically: into a temporary folder, then renamed); None when the graph
    is not cacheable or the disk refuses."""
    if not kernels or any(not getattr(k, "cubin", b"") for k in kernels):
        return None
    final = entry_dir(key)
    vars_ = VarTable()
    try:
        doc = {"key": key, "name": compiled.name, "inputs": compiled.inputs, "slots": compiled.slot_count,
               "steps": _steps_json(compiled, vars_), "frees": [list(f) for f in compiled.frees],
               "outputs": _encode(compiled.outputs, vars_),
               "sizes": [[expr_to_json(v), position, dim] for v, position, dim in compiled.sizes],
               "report": {"name": report.name, "programs": report.programs, "fallbacks": report.fallbacks,
                          "placement": report.placement}}
        final.parent.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix=f".{key[:12]}.", dir=final.parent))
        for number, kernel in enumerate(kernels):
            kernel.save(work / f"p{number}")
        (work / "graph.json").write_text(json.dumps(doc))
        try:
            os.replace(work, final)
        except OSError:  # an entry is there: another process stored it first, or it is damaged
            if load_graph(key) is None:  # damaged (this compile missed it): replace it
                shutil.rmtree(final, ignore_errors=True)
                try:
                    os.replace(work, final)
                except OSError:
                    pass
            shutil.rmtree(work, ignore_errors=True)  # gone once renamed
        return final
    except (NotCacheable, OSError, ValueError, TypeError):
        return None


def load_graph(key: str) -> tuple[CompiledGraph, GraphReport] | None:
    """The compiled graph of an entry, or None (no entry, or one that cannot be read)."""
    folder = entry_dir(key)
    try:
        doc = json.loads((folder / "graph.json").read_text())
        if doc.get("key") != key:
            return None
        vars_ = VarTable()
        kernels = {}
        for step in doc["steps"]:
            if step["kind"] == "program":
                kernels[step["artifact"]] = load(folder / step["artifact"])
        steps = _steps_from(doc["steps"], kernels, vars_)
        sizes = [(expr_from_json(v, vars_), int(position), dim) for v, position, dim in doc["sizes"]]
        compiled = CompiledGraph(doc["name"], int(doc["inputs"]), int(doc["slots"]), steps,
                                 [tuple(f) for f in doc["frees"]], _decode(doc["outputs"], vars_), sizes)
        r = doc["report"]
        report = GraphReport(r["name"], [tuple(p) for p in r["programs"]],  # type: ignore[misc]
                             {op: [tuple(n) for n in nodes] for op, nodes in r["fallbacks"].items()},  # type: ignore[misc]
                             r["placement"], 0.0)
        compiled.report = report
        return compiled, report
    except (OSError, ValueError, KeyError, TypeError, AttributeError, Exception):  # noqa: BLE001 - a miss
        return None
