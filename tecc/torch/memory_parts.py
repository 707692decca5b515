"""A backward graph's program cut into parts so that its memory comes and goes as it runs.

One program allocates every output before its first kernel and frees its inputs after its last
(runtime.py). For a backward graph that is the worst moment twice over: every parameter gradient
is allocated while every saved tensor is still held. Cut into parts run in order, each part's
outputs are allocated when it starts, and a saved tensor is freed after the last part that reads
it (the launch list frees a slot after its last reader), as a fusing compiler that frees each
buffer after its last use does.

A cut costs what crosses it: a value computed before and read after becomes an output of the
earlier part (written to memory, where one program could have kept it in registers or in the
stream arena). A value that a GEMM or a convolution reads is in memory anyway (its kernel stages
its operand tiles from there), so it crosses for free. So the cuts go where the least crosses:
the graph order is walked, and once the parts before a candidate would free or allocate a share
of the level's volume (`PARTS` parts at most, each at least `MIN_PART_BYTES`), the cut is the
position in the next such share where the fewest bytes cross, taken only if they are under a
quarter of the share. Between layers of a transformer's backward that is one activation's
gradient; after a loss head's backward row kernel it is the logits' gradient (which the head's
GEMMs read), so the saved logits are freed before those GEMMs run. A position where a
multi-output value (a tuple) crosses is never a cut: only tensors leave a program.

Only backward graphs are cut (their inputs are the saved tensors, which die as the backward
consumes them; a forward's are parameters and the user's inputs, held by their owners), and only
levels whose volume is at least two parts. `memory_parts=False` (a backend option) keeps one
program per level.
"""

from __future__ import annotations

from bisect import bisect_left
from itertools import accumulate
from typing import Sequence

import torch
from torch.fx import GraphModule, Node

from .graph import ATEN, TECC, is_view_node, users_outside, view_base
from .lowering.context import static_int

PARTS = 8                    # parts of one level at most
MIN_PART_BYTES = 64 << 20    # a part frees or allocates at least this much
# the ops whose kernels read their operands from memory, tile by tile (the cost of a crossing
# only: no rewrite depends on this list)
_STAGED = {torch.ops.aten.mm.default, torch.ops.aten.bmm.default, torch.ops.aten.addmm.default,
           torch.ops.aten.baddbmm.default, torch.ops.aten.convolution.default,
           torch.ops.aten.convolution_backward.default}
_UNCUTTABLE = float(1 << 60)  # what a tuple crossing a position counts (finite: it is subtracted again)


def split_levels(gm: GraphModule, kinds: dict[Node, str], level: dict[Node, int]) -> dict[Node, int]:
    """The levels renumbered with each level's parts (module docstring): the members of part p
    of a level get that level's first number + p, and its fallbacks (which run after its
    program, launch.py) the number of its last part."""
    members: dict[int, list[Node]] = {}
    for node in gm.graph.nodes:
        if kinds.get(node) == TECC:
            members.setdefault(level[node], []).append(node)
    last: dict[int, int] = {}
    parts: dict[Node, int] = {}
    number = 0
    for lvl in sorted(set(level.values())):
        nodes = members.get(lvl, [])
        cuts = part_cuts(nodes, kinds, level, lvl) if nodes else []
        bounds = [0, *cuts, len(nodes)]
        for part, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
            for node in nodes[lo:hi]:
                parts[node] = number + part
        last[lvl] = number + len(cuts)
        number += len(cuts) + 1
    return {node: parts[node] if kinds.get(node) == TECC else last[lvl]
            for node, lvl in level.items() if kinds.get(node) in (TECC, ATEN)}


def part_cuts(nodes: Sequence[Node], kinds: dict[Node, str], level: dict[Node, int], lvl: int) -> list[int]:
    """The positions in `nodes` (one level's members, graph order) before which a new part
    starts (module docstring); [] keeps the level one program."""
    n = len(nodes)
    position = {node: i for i, node in enumerate(nodes)}
    last: dict[Node, int] = {}         # a value (a view's base) -> the last member reading it
    for i, node in enumerate(nodes):
        if is_view_node(node, kinds):
            continue
        for a in node.all_input_nodes:
            last[_root(a, kinds)] = i
    # bytes a member allocates (an output) or frees (an input's last read here: one that a later
    # level reads too is counted, an overestimate that moves a cut, not its correctness)
    volume = [0] * n
    starts = [0.0] * (n + 2)           # bytes that start (+) and stop (-) crossing at each position
    for value, i in last.items():
        if value not in position:
            volume[i] += _bytes(value) or 0
    for i, node in enumerate(nodes):
        if is_view_node(node, kinds):
            continue
        if users_outside(node, kinds, level, lvl):
            volume[i] += _bytes(node) or 0
            continue
        end = last.get(node, i)
        if end > i and not _staged_operand(node, kinds):
            size = _bytes(node)
            starts[i + 1] += _UNCUTTABLE if size is None else size
            starts[end + 1] -= _UNCUTTABLE if size is None else size
    crossing = list(accumulate(starts))  # crossing[p]: bytes computed before position p and read from p on
    before = [0, *accumulate(volume)]  # before[p]: the volume of positions < p
    total = before[n]
    share = max(total / PARTS, MIN_PART_BYTES)
    if total < 2 * share:
        return []
    cuts: list[int] = []
    start = 0
    lo = _reaching(before, before[start] + share)
    while lo < n:
        hi = _reaching(before, before[lo] + share)
        candidates = [p for p in range(lo, min(hi, n - 1) + 1) if total - before[p] >= share / 2]
        best = min(candidates, key=lambda p: (crossing[p], p), default=None)
        if best is not None and crossing[best] <= share / 4:
            cuts.append(best)
            start = best
            lo = _reaching(before, before[start] + share)
        else:
            lo = hi + 1
    return cuts


def _reaching(before: list[int], volume: float) -> int:
    """The first position p whose volume before it reaches `volume` (len - 1 when none does;
    `before` never decreases)."""
    return min(bisect_left(before, volume), len(before) - 1)


def _staged_operand(node: Node, kinds: dict[Node, str]) -> bool:
    """Whether a GEMM or a convolution reads `node` (directly or through views)."""
    for user in node.users:
        if user.target in _STAGED or (is_view_node(user, kinds) and _staged_operand(user, kinds)):
            return True
    return False


def _root(node: Node, kinds: dict[Node, str]) -> Node:
    return view_base(node, kinds) if is_view_node(node, kinds) else node


def _bytes(node: Node) -> int | None:
    """The bytes of a node's tensor value (symbolic sizes at their hints); 0 for a non-tensor
    scalar; None for a tuple or list of values, or a size without a hint."""
    val = node.meta.get("val")
    if isinstance(val, (tuple, list)):
        return None
    if not isinstance(val, torch.Tensor):
        return 0
    count = 1
    for s in val.shape:
        size = static_int(s)
        if size is None:
            hint = getattr(getattr(s, "node", None), "hint", None)
            if hint is None:
                return None
            size = int(hint)
        count *= size
    return count * val.element_size()
