"""tecc kernels as PyTorch ops (docs/pytorch.md); re-exported by `tecc.torch`.

    import tecc as tc
    f = tc.build([A, B, bias, Y])                    # or give the tensors: op() builds them
    g = tc.grad(Y, [A, B, bias])                     # backward tensor expressions
    gemm = tc.torch.op(f, "mylib::gemm_bias_gelu", grads=g)
    y = gemm(a, b, bias)                             # torch tensors in, torch tensor out
    y.sum().backward()                               # the backward kernel, built from g

`op` registers the kernel through `torch.library.custom_op`, with a fake implementation whose
output shapes and dtypes come from the tensor expression (so `torch.compile(fullgraph=True)`
traces it without a graph break, dynamic shapes included, and `torch.library.opcheck` passes);
with `grads` the backward program is compiled too, registered as the op `<name>_backward`, and
wired in with `register_autograd`. `function` gives the same pair as a `torch.autograd.Function`
without registering anything.

CUDA tensors run the compiled kernel on torch's current stream, outputs from torch's caching
allocator (capturable in a CUDA graph after one warm-up call); CPU tensors run the same kernel IR
in the emulator (for gradcheck without a GPU).

The top layer, like cli.py: torch is imported here and only here, on first use of `tc.torch`;
`import tecc` never imports it.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Sequence

import numpy as np
import torch

from ..compiler import build
from ..compiler.kernel import Kernel
from ..ir.autodiff import Gradients
from ..ir.dtype import DType
from ..ir.errors import DTypeError, ShapeError, TeccError
from ..ir.evaluate import evaluate
from ..ir.expr import Var, free_vars
from ..ir.stmt import Buffer
from ..ir.tensor import Tensor
from ..runtime.launch_cache import LaunchEntry
from ..runtime.outputs import OutputAllocator, returned
from .runtime import tensor_guard

__all__ = ["TorchOp", "function", "op", "torch_dtype"]


def torch_dtype(dtype: DType) -> Any:
    """The torch dtype of a tecc dtype (`float32` -> torch.float32, `bool` -> torch.bool)."""
    return getattr(torch, dtype.name)


class _Signature:
    """A kernel's inputs and outputs as torch sees them: names, dtypes, and the output shapes as
    functions of the inputs' (possibly symbolic) sizes."""

    def __init__(self, kernel: Kernel, what: str) -> None:
        self.kernel = kernel
        self.allocator = OutputAllocator(kernel.host)
        self.inputs: tuple[Buffer, ...] = self.allocator.inputs
        self.outputs: tuple[Buffer, ...] = self.allocator.outputs
        if not self.outputs:
            raise TeccError(f"{what}: kernel {kernel.name} writes none of its parameters; an op needs an output")
        bound = {dim for buf in self.inputs for dim in buf.shape if isinstance(dim, Var)}
        for buf in self.outputs:
            for pos, dim in enumerate(buf.shape):
                missing = sorted(v.name for v in free_vars(dim) if v not in bound)
                if missing:
                    raise ShapeError(
                        f"{what}: output {buf.name}'s dimension {pos} ({dim}) needs {', '.join(missing)}, which no "
                        f"input's shape determines; a torch op must derive every output size from its inputs"
                    )
        self.contiguous = tuple(buf.strides is None for buf in self.inputs)
        positions = self.allocator.positions
        self._inputs_first = list(positions) == sorted(positions)   # the signature: inputs, then outputs
        # per layout of the inputs (as `call` reads it): the launch-cache entry a call of it ran
        # as, its prepared launch (or None), its outputs' shapes (None: made like the first
        # input) and dtypes, and their device
        self._relaunch: dict[tuple[Any, ...], tuple[LaunchEntry, Callable[[list[int]], bool] | None,
                                                    tuple[tuple[tuple[int, ...] | None, Any], ...], Any]] = {}
        # the last layout's entry, with a C++ check of its tensors (runtime.tensor_guard): a call
        # that passes it takes the entry without its layout read in Python (~1 us less)
        self._last: tuple[Any, Any] | None = None

    def schema(self) -> str:
        names = [_argument_name(buf.name, pos) for pos, buf in enumerate(self.inputs)]
        returns = "Tensor" if len(self.outputs) == 1 else "(" + ", ".join("Tensor" for _ in self.outputs) + ")"
        return "(" + ", ".join(f"Tensor {n}" for n in names) + ") -> " + returns

    def check(self, tensors: Sequence[Any], what: str) -> None:
        """Rank and dtype of each input (sizes are the kernel's to check)."""
        if len(tensors) != len(self.inputs):
            names = ", ".join(b.name for b in self.inputs)
            raise TeccError(f"{what} takes {len(self.inputs)} tensors ({names}), got {len(tensors)}")
        for pos, (t, buf) in enumerate(zip(tensors, self.inputs)):
            if t.dim() != buf.ndim:
                raise ShapeError(f"{what}: argument {pos} ({buf.name}) must have {buf.ndim} dimensions "
                                 f"[{', '.join(str(s) for s in buf.shape)}], got shape {tuple(t.shape)}")
            if t.dtype != torch_dtype(buf.dtype):
                raise DTypeError(f"{what}: argument {pos} ({buf.name}) must be {buf.dtype.name}, got {t.dtype}")

    def fake(self, tensors: Sequence[Any]) -> Any:
        """Empty outputs of the right (possibly symbolic) shapes and dtypes, like the inputs."""
        env: dict[Var, Any] = {}
        for buf, t in zip(self.inputs, tensors):
            for dim, n in zip(buf.shape, t.shape):
                if isinstance(dim, Var) and dim not in env:
                    env[dim] = n
        like = tensors[0]
        outs = [like.new_empty(tuple(evaluate(dim, env) for dim in buf.shape), dtype=torch_dtype(buf.dtype))
                for buf in self.outputs]
        return outs[0] if len(outs) == 1 else tuple(outs)

    def call(self, *tensors: Any) -> Any:
        """`run(tensors)`, the implementation a registered op calls (tensors as arguments).

        On CUDA tensors whose layouts (sizes, strides, dtype, device of each) an earlier call
        had, the outputs are allocated as then and that call's launch runs again on the new data
        pointers alone (RunnableKernel.prepared / relaunch: alignment and streams as on any
        launch-cache hit), without reading each argument's key again: the host time of a call is
        then mostly torch's own dispatch of the op (docs/pytorch.md, "Host time per call").
        (The layout read inline and the tensors passed bare: each Python frame and call on this
        path is a visible share of a call's ~20 us.)"""
        last = self._last
        try:
            hit = last is not None and last[0].check(*tensors)
        except TypeError:   # not a tensor, or another count of them
            hit = False
        if hit and last is not None:
            known = last[1]
        else:
            try:
                # (a layout with the lazy negative or conjugate bit is never remembered: `run`)
                layout = tuple([(t.shape, t.stride(), t.dtype, t.get_device(), t.is_neg() or t.is_conj())
                                for t in tensors])
            except (AttributeError, TypeError):   # not a tensor (an array has no stride())
                return self.run(tensors, None)
            known = self._relaunch.get(layout)
            if known is None:
                return self.run(tensors, layout)
            guard = tensor_guard(tensors)
            self._last = None if guard is None else (guard, known)
        entry, prepared, recipe, device = known
        # an output of the first input's sizes, dtype and (contiguous) strides is made like it,
        # ~1.5 us less than torch.empty; the sizes as separate arguments otherwise
        outputs = [torch.empty_like(tensors[0]) if shape is None else torch.empty(*shape, dtype=dtype, device=device)
                   if shape else torch.empty((), dtype=dtype, device=device) for shape, dtype in recipe]
        full = (*tensors, *outputs) if self._inputs_first else self.allocator.interleave(tensors, outputs)
        ptrs = [t.data_ptr() for t in full]
        if prepared(ptrs) if prepared is not None else self.kernel.relaunch(entry, ptrs, full):
            return outputs[0] if len(outputs) == 1 else tuple(outputs)
        return self.run(tensors, layout)

    def run(self, tensors: Sequence[Any], layout: tuple[Any, ...] | None = None) -> Any:
        """The kernel on torch tensors: compiled on CUDA tensors, in the emulator on CPU ones.
        `layout` (`call`'s reading of the tensors' layouts, None: not known): a CUDA call of it
        is remembered for `call` to relaunch."""
        args = []
        copied = False
        for t, contiguous in zip(tensors, self.contiguous):
            if t.requires_grad:
                t = t.detach()  # DLPack refuses to export a tensor that requires grad
            if contiguous and not t.is_contiguous():
                t = t.contiguous()
                copied = True
            args.append(t)
        if args and args[0].is_cuda:
            if self.kernel.target == "sim":
                raise TeccError(f"{self.kernel.name} was built for the emulator (target='sim') and got CUDA tensors; "
                                "build it with target='cuda', or pass CPU tensors")
            if (layout is None or copied or len(self._relaunch) >= LAYOUTS_KEPT
                    or any(device == -1 or lazy for *_, device, lazy in layout)):
                return self.kernel(*args)
            full, outputs = self.allocator.complete(args)
            entry = self.kernel.call_entry(*full)
            if entry is not None:
                first = args[0]
                recipe = tuple((None if o.shape == first.shape and o.dtype == first.dtype and first.is_contiguous()
                                else tuple(o.shape), o.dtype) for o in outputs)
                self._relaunch[layout] = (entry, self.kernel.prepared(entry), recipe, outputs[0].device)
            return returned(outputs)
        arrays = [t.numpy() for t in args]
        outs = self.kernel.sim(*arrays)
        if isinstance(outs, tuple):
            return tuple(torch.from_numpy(np.ascontiguousarray(o)) for o in outs)
        return torch.from_numpy(np.ascontiguousarray(outs))


# Distinct input layouts an op relaunches (a model calls an op with a few).
LAYOUTS_KEPT = 16


def _argument_name(name: str, pos: int) -> str:
    reserved = {"self", "out", "Tensor", "int", "float", "bool"}
    return name if name.isidentifier() and name not in reserved else f"arg{pos}"


def _as_kernel(program: Kernel | Sequence[Tensor], target: str, options: dict[str, Any]) -> Kernel:
    if isinstance(program, Kernel):
        return program
    return build(list(program), target=target, **options)


class _Backward:
    """The backward kernel of `grads` and how its results map onto the forward's inputs."""

    def __init__(self, forward: _Signature, grads: Gradients, kernel: Kernel, what: str) -> None:
        outputs = [b.name for b in forward.outputs]
        if outputs != [grads.output.name]:
            raise TeccError(
                f"{what}: the gradients are those of {grads.output.name}, but the kernel's outputs are "
                f"{', '.join(outputs)}; differentiate the kernel's one output"
            )
        names = [b.name for b in forward.inputs]
        missing = [t.name for t in grads.inputs if t.name not in names]
        if missing:
            raise TeccError(f"{what}: the gradient program reads {', '.join(missing)}, which the kernel does not take")
        self.signature = _Signature(kernel, what + " (backward)")
        expected = [t.name for t in grads.args]
        got = [b.name for b in kernel.host.buffer_params]
        if got != expected:
            raise TeccError(f"{what}: the backward kernel's signature is ({', '.join(got)}); build it from "
                            f"grads.args ({', '.join(expected)})")
        self.take = tuple(names.index(t.name) for t in grads.inputs)  # forward input -> backward argument
        self.saved = len(grads.saved)   # the last len(saved) tensors of grads.forward
        wrt = [x.name for x in grads.wrt]
        self.gives = tuple(wrt.index(n) if n in wrt else None for n in names)  # forward input -> its gradient

    def arguments(self, saved: Sequence[Any], cotangent: Any, values: Callable[..., Any] | None = None) -> list[Any]:
        """The backward kernel's arguments from the forward's inputs `saved` and the cotangent.
        When the gradient reads forward values (`grads.saved`: statistics given as `save=`,
        attention's output and log-sum-exp), `values` (the forward built from `grads.forward`)
        recomputes them from the inputs first, and its last len(grads.saved) outputs are passed:
        the op saves only its inputs."""
        inputs = [saved[i] for i in self.take]
        if not self.saved:
            return inputs + [cotangent]
        if values is None:
            raise TeccError("the gradient reads forward values (grads.saved); pass the forward built from grads.forward")
        found = values(*inputs)
        outputs = list(found if isinstance(found, tuple) else (found,))
        return inputs + outputs[len(outputs) - self.saved:] + [cotangent]

    def per_input(self, grads: Any) -> tuple[Any, ...]:
        found = grads if isinstance(grads, tuple) else (grads,)
        return tuple(None if k is None else found[k] for k in self.gives)


class TorchOp:
    """A tecc kernel registered as the torch op `name` (see `op`): call it with torch tensors.

    `custom_op` is the torch CustomOpDef (what torch.compile traces), `backward_op` the one of
    the backward kernel (None without gradients), `kernel` / `backward_kernel` the tecc kernels."""

    def __init__(self, name: str, custom_op: Any, kernel: Kernel, backward_op: Any = None,
                 backward_kernel: Kernel | None = None) -> None:
        self.name = self.__name__ = name
        self.custom_op = custom_op
        self.kernel = kernel
        self.backward_op = backward_op
        self.backward_kernel = backward_kernel
        self.overload = _overload(name)

    def __call__(self, *tensors: Any) -> Any:
        return self.overload(*tensors)

    def __repr__(self) -> str:
        return f"<tecc.torch op {self.name} ({self.kernel.name})>"


def _overload(name: str) -> Any:
    """torch.ops.<namespace>.<op>.default: what a custom op's __call__ calls, and what
    torch.compile traces as one node."""
    namespace, _, opname = name.partition("::")
    return getattr(getattr(torch.ops, namespace), opname).default


# The ops this process registered, by name, with the identity of their programs (forward,
# backward); and the backward (and saved-values) ops they registered, by name, with what they are
# ("the backward op of NAME").
# torch.library lets a second registration under a name replace the first silently, so that the
# first op's callers would run the second program.
_REGISTERED: dict[str, tuple[tuple[Any, ...], "TorchOp"]] = {}
_BACKWARDS: dict[str, str] = {}


def _identity(kernel: Kernel | None) -> tuple[str, ...]:
    """What makes two kernels the same program for an op: the host program (signature, kernels,
    launches), the CUDA C emitted from the final loop IR, the target and the arch."""
    if kernel is None:
        return ()
    return (json.dumps(kernel.host.to_json(), sort_keys=True), kernel.source, kernel.target, kernel.arch)


def _describe(kernel: Kernel) -> str:
    """A kernel's program in one phrase: `kernel C(A: float32[M, K], B: float32[K, 6]) -> C: float32[M, 6]`."""
    allocator = OutputAllocator(kernel.host)

    def buffer(b: Buffer) -> str:
        return f"{b.name}: {b.dtype.name}[{', '.join(str(d) for d in b.shape)}]"

    return (f"kernel {kernel.name}({', '.join(buffer(b) for b in allocator.inputs)}) -> "
            f"{', '.join(buffer(b) for b in allocator.outputs)}")


def _already_registered(name: str, forward: Kernel, backward: Kernel | None) -> TorchOp | None:
    """The op this process registered as `name` when it runs the same programs (forward and
    backward), else None; TeccError naming both programs when other programs hold the name."""
    if name in _BACKWARDS:
        raise TeccError(f"op {name} is already registered: it is {_BACKWARDS[name]}; "
                        "give this op another name")
    if backward is not None and name + "_backward" in _REGISTERED:
        raise TeccError(f"op {name} would register its backward as {name}_backward, which is already an op "
                        f"(it runs {_describe(_REGISTERED[name + '_backward'][1].kernel)}); give this op another name")
    taken = _REGISTERED.get(name)
    if taken is None:
        return None
    (held_forward, held_backward), existing = taken
    if (held_forward, held_backward) == (_identity(forward), _identity(backward)):
        return existing
    theirs, mine = _describe(existing.kernel), _describe(forward)
    if held_forward != _identity(forward):
        differs = f"it runs {theirs}; this one is {mine}"
        if theirs == mine:
            differs += " (the same signature, another computation, target or arch)"
    else:
        def grads(kernel: Kernel | None) -> str:
            return "no gradients" if kernel is None else f"the gradients of {_describe(kernel)}"

        differs = f"both run {mine}, it with {grads(existing.backward_kernel)}, this one with {grads(backward)}"
    raise TeccError(f"op {name} is already registered with another program ({differs}); give this one another "
                    "name, or use the op registered first (torch cannot unregister an op within a process)")


def _register(name: str, signature: _Signature) -> Any:
    what = f"op {name}"

    custom = torch.library.custom_op(name, signature.call, mutates_args=(), schema=signature.schema())

    def fake(*tensors: Any) -> Any:
        signature.check(tensors, what)
        return signature.fake(tensors)

    custom.register_fake(fake)
    return custom


def op(program: Kernel | Sequence[Tensor], name: str, *, grads: Gradients | None = None,
       backward: Kernel | Sequence[Tensor] | None = None, target: str = "cuda", **build_options: Any) -> TorchOp:
    """Register a tecc kernel as the torch custom op `name` ("namespace::op").

    program: a built kernel, or its signature (tensors) to build for `target` with `build_options`.
    The op takes the kernel's inputs (its parameters that no kernel writes), in signature order,
    and returns its outputs (one bare, several as a tuple), allocated by torch.
    grads: `tc.grad(output, wrt)` of the kernel's one output; the backward kernel (`backward`, or
    built from `grads.args`) is registered as `<name>_backward` and supplies the gradients of the
    `wrt` inputs (None for the others). A name holds one program per process: registering the
    same programs again returns the op registered first; other programs under a taken name are
    a TeccError that names both."""
    if name.count("::") != 1 or not all(part.isidentifier() for part in name.split("::")):
        raise TeccError(f"op name {name!r} must read 'namespace::name', both parts Python identifiers "
                        "(e.g. 'mylib::gemm_bias')")
    kernel = _as_kernel(program, target, build_options)
    forward = _Signature(kernel, f"op {name}")
    back_kernel = None
    if grads is not None:
        back_kernel = _as_kernel(backward if backward is not None else grads.args, target, build_options)
    existing = _already_registered(name, kernel, back_kernel)
    if existing is not None:  # the same programs again: torch keeps one op per name
        return existing
    if back_kernel is None or grads is None:
        made = TorchOp(name, _register(name, forward), kernel)
    else:
        made = _register_with_gradients(name, forward, grads, back_kernel, target, build_options)
        _BACKWARDS[name + "_backward"] = f"the backward op of {name}"
        if grads.saved:
            _BACKWARDS[name + "_saved"] = f"the op of {name}'s saved values"
    _REGISTERED[name] = ((_identity(kernel), _identity(back_kernel)), made)
    return made


def _register_with_gradients(name: str, forward: _Signature, grads: Gradients, back_kernel: Kernel, target: str,
                             build_options: dict[str, Any]) -> TorchOp:
    """The op `name` and its backward op `<name>_backward`, wired with register_autograd; with
    `grads.saved`, also `<name>_saved`, the forward built from `grads.forward`."""
    back = _Backward(forward, grads, back_kernel, f"op {name}")
    custom = _register(name, forward)
    back_custom = _register(name + "_backward", back.signature)
    # the forward values the gradient reads (saved statistics; attention's output and log-sum-exp), an op of its own
    values = _register(name + "_saved", _Signature(_as_kernel(list(grads.forward), target, build_options),
                                                   f"op {name} (saved values)")) if grads.saved else None

    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.save_for_backward(*inputs)

    def backward_formula(ctx: Any, grad_output: Any) -> tuple[Any, ...]:
        return back.per_input(back_custom(*back.arguments(ctx.saved_tensors, grad_output, values)))

    custom.register_autograd(backward_formula, setup_context=setup_context)
    return TorchOp(name, custom, forward.kernel, back_custom, back_kernel)


def function(program: Kernel | Sequence[Tensor], grads: Gradients, *, backward: Kernel | Sequence[Tensor] | None = None,
             target: str = "cuda", **build_options: Any) -> Callable[..., Any]:
    """The kernel and its backward as a `torch.autograd.Function`, without registering an op:
    returns `apply(*tensors)`. (Under torch.compile prefer `op`, which traces without a break.)"""
    kernel = _as_kernel(program, target, build_options)
    forward = _Signature(kernel, f"function {kernel.name}")
    back_kernel = _as_kernel(backward if backward is not None else grads.args, target, build_options)
    back = _Backward(forward, grads, back_kernel, f"function {kernel.name}")
    values = None
    if grads.saved:
        saver = _Signature(_as_kernel(list(grads.forward), target, build_options), f"function {kernel.name} (saved values)")

        def values(*tensors: Any) -> Any:
            return saver.run(tensors)

    class TeccFunction(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, *tensors: Any) -> Any:
            forward.check(tensors, f"function {kernel.name}")
            ctx.save_for_backward(*tensors)
            return forward.run(tensors)

        @staticmethod
        def backward(ctx: Any, grad_output: Any) -> Any:
            return back.per_input(back.signature.run(back.arguments(ctx.saved_tensors, grad_output, values)))

    TeccFunction.__name__ = TeccFunction.__qualname__ = f"TeccFunction_{kernel.name}"
    return TeccFunction.apply  # type: ignore[no-any-return]
