"""The decomposition table AOTAutograd traces with: torch's own, never hand-written.

`torch._decomp.core_aten_decompositions()` takes the graph to core ATen; on top of it, torch's
decompositions of the composite ops that core ATen keeps but tecc computes from their parts
(layer norm -> var_mean, rsqrt, ...; softmax -> amax, exp, sum, div; gelu -> erf; batch norm;
pooling; dropout as `rand_like(x) > p`; ...), so the lowering table only needs the parts. Left
out on purpose: the CPU flash attention op, which tecc lowers as a whole (lowering/attention.py)
so that its program keeps the attention form the online-contraction rewrite recognises, and the
embedding's backward, one tc.scatter_add (lowering/indexing.py).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import torch
from torch._decomp import core_aten_decompositions, get_decompositions

aten = torch.ops.aten

# composite ops core ATen keeps, decomposed with torch's own decompositions
EXTRA = (
    aten.native_layer_norm, aten._softmax, aten._log_softmax, aten.gelu, aten.silu, aten.mish, aten.hardswish,
    aten.hardsigmoid, aten.hardtanh, aten.leaky_relu, aten.elu, aten.softplus, aten.native_batch_norm,
    aten._native_batch_norm_legit, aten._native_batch_norm_legit_no_training,
    aten._native_batch_norm_legit_functional, aten.clamp_min, aten.clamp_max, aten.linalg_vector_norm,
    aten.native_group_norm, aten.native_dropout, aten.addcmul, aten.addcdiv, aten.lerp,
)

# decompositions tecc does not want: it lowers these ops as a whole
KEEP = (
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    # one tc.scatter_add (torch's decomposition is a masked copy of the gradient, then an
    # index_put into zeros)
    aten.embedding_dense_backward.default,
)


def _build() -> dict[Any, Any]:
    table = dict(core_aten_decompositions())
    table.update(get_decompositions(list(EXTRA)))
    for op in KEEP:
        table.pop(op, None)
    return table


class _Table(dict[Any, Any]):
    """The table, built at its first read (~0.1-0.2 s): AOTAutograd reads it only when it traces,
    so a hit of its cache (a second process) never builds it. Every read goes through a method
    that builds it first; once built, the entries are the dict's own."""

    _built = False

    def _ready(self) -> "_Table":
        if not self._built:
            super().update(_build())
            self._built = True  # after the entries: a concurrent reader builds again rather than reads half
        return self

    def __len__(self) -> int:
        return super(_Table, self._ready()).__len__()

    def __iter__(self) -> Iterator[Any]:
        return super(_Table, self._ready()).__iter__()

    def __contains__(self, key: object) -> bool:
        return super(_Table, self._ready()).__contains__(key)

    def __getitem__(self, key: Any) -> Any:
        return super(_Table, self._ready()).__getitem__(key)

    def get(self, key: Any, default: Any = None) -> Any:
        return super(_Table, self._ready()).get(key, default)

    def keys(self) -> Any:
        return super(_Table, self._ready()).keys()

    def items(self) -> Any:
        return super(_Table, self._ready()).items()

    def values(self) -> Any:
        return super(_Table, self._ready()).values()

    def copy(self) -> dict[Any, Any]:
        return dict(self.items())


@functools.cache
def decomposition_table() -> dict[Any, Any]:
    """The table (one per process, built at its first read). AOTAutograd only reads it."""
    return _Table()
