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
its operand tiles from there), so it crosses for free. And each part is built on its own: a
model's repeated layers in two parts are compiled twice (the kernel twins that make a layer's
kernels one compile are found within a program). So the cuts are few and where they pay:

1. **Candidates.** The graph order is walked; once the parts before a position would free or
   allocate a share of the level's volume (`PARTS` parts at most, each at least
   `MIN_PART_BYTES`), the candidate is the position in the next share where the fewest bytes
   cross, if under a quarter of the share (between a transformer's layers: one activation's
   gradient; after a loss head's backward row kernel: the logits' gradient, which the head's
   GEMMs read).
2. **Cuts.** A ledger of the level (`_Ledger.peak`: in each part, the inputs not yet freed, the
   outputs so far, the values crossing a cut, the in-memory values inside the part) models the
   peak for a set of cuts; candidates are added greedily while one lowers it by at least
   `MIN_GAIN_BYTES` and 2%. GPT-2's backward gets one cut, after the loss head's row kernel: the
   saved logits die before the head's GEMMs run, and the layers' gradients are allocated after
   that; a cut between layers would lower no peak (the saved activations are all alive at the
   start) and compile the layers' kernels twice.

A position where a multi-output value (a tuple) crosses is never a cut: only tensors leave a
program.

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
MIN_GAIN_BYTES = 64 << 20    # a cut lowers the modelled peak by at least this much (and 2%)
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
    starts (module docstring): of the candidates `_candidates` finds, those that lower the
    level's modelled peak (`_Ledger`), each by at least `MIN_GAIN_BYTES` and 2%, taken greedily;
    [] keeps the level one program."""
    ledger = _Ledger(nodes, kinds, level, lvl)
    candidates = ledger.candidates()
    cuts: list[int] = []
    peak = ledger.peak(cuts)
    while candidates and len(cuts) < PARTS - 1:
        tried = min(((ledger.peak(sorted([*cuts, c])), c) for c in candidates), key=lambda t: (t[0], t[1]))
        if peak - tried[0] < max(MIN_GAIN_BYTES, 0.02 * peak):
            break
        peak = tried[0]
        cuts = sorted([*cuts, tried[1]])
        candidates.remove(tried[1])
    return cuts


class _Ledger:
    """One level's members as memory: the inputs each freed after its last reader here, the
    outputs each allocated when its part starts, and the values computed here that are read
    later (start, end, bytes, whether in memory anyway: a GEMM's or convolution's operand).
    An input a later level reads too is counted as freed: an overestimate that moves a cut,
    not its correctness."""

    def __init__(self, nodes: Sequence[Node], kinds: dict[Node, str], level: dict[Node, int], lvl: int) -> None:
        self.n = n = len(nodes)
        position = {node: i for i, node in enumerate(nodes)}
        last: dict[Node, int] = {}         # a value (a view's base) -> the last member reading it
        for i, node in enumerate(nodes):
            if is_view_node(node, kinds):
                continue
            for a in node.all_input_nodes:
                last[_root(a, kinds)] = i
        self.inputs = [(i, _bytes(v) or 0) for v, i in last.items() if v not in position]    # (last read, bytes)
        self.outputs: list[tuple[int, int]] = []                                            # (position, bytes)
        self.values: list[tuple[int, int, float, bool]] = []                                 # (start, end, bytes, staged)
        for i, node in enumerate(nodes):
            if is_view_node(node, kinds):
                continue
            if users_outside(node, kinds, level, lvl):
                self.outputs.append((i, _bytes(node) or 0))
            elif last.get(node, i) > i:
                size = _bytes(node)
                self.values.append((i, last[node], _UNCUTTABLE if size is None else float(size),
                                    _staged_operand(node, kinds)))
        self.total_in = sum(b for _, b in self.inputs)

    def candidates(self) -> list[int]:
        """Where a cut may go: walking the graph order, once the parts before a position free or
        allocate a share of the level's volume (`PARTS` parts at most, each at least
        `MIN_PART_BYTES`), the position in the next share where the fewest bytes cross that
        would not be in memory anyway, if under a quarter of the share."""
        n = self.n
        volume = [0] * n
        for i, b in self.inputs + self.outputs:
            volume[i] += b
        starts = [0.0] * (n + 2)           # bytes that start (+) and stop (-) crossing at each position
        for i, end, size, staged in self.values:
            if not staged:
                starts[i + 1] += size
                starts[end + 1] -= size
        crossing = list(accumulate(starts))  # crossing[p]: bytes computed before p and read from p on
        before = [0, *accumulate(volume)]  # before[p]: the volume of positions < p
        total = before[n]
        share = max(total / PARTS, MIN_PART_BYTES)
        if total < 2 * share:
            return []
        found: list[int] = []
        lo = _reaching(before, share)
        while lo < n:
            hi = _reaching(before, before[lo] + share)
            window = [p for p in range(lo, min(hi, n - 1) + 1) if total - before[p] >= share / 2]
            best = min(window, key=lambda p: (crossing[p], p), default=None)
            if best is not None and crossing[best] <= share / 4:
                found.append(best)
                lo = _reaching(before, before[best] + share)
            else:
                lo = hi + 1
        return found

    def peak(self, cuts: Sequence[int]) -> float:
        """The most bytes live in one part when the level is cut at `cuts` (sorted): the inputs
        not yet freed, the outputs of this part and the earlier ones, the values crossing a cut
        that are alive during the part (outputs of an earlier part or of this one), and the most
        bytes live at once of the values in memory anyway that stay inside the part (a
        program's temporaries)."""
        bounds = [0, *cuts, self.n]
        crosses = [any(i < c <= end for c in cuts) for i, end, _, _ in self.values]
        crossing = [(i, end, size) for (i, end, size, _), x in zip(self.values, crosses) if x]
        in_memory = [(i, end, size) for (i, end, size, staged), x in zip(self.values, crosses) if staged and not x]
        peak = 0.0
        for lo, hi in zip(bounds, bounds[1:]):
            live = (self.total_in - sum(b for i, b in self.inputs if i < lo)
                    + sum(b for i, b in self.outputs if i < hi)
                    + sum(size for i, end, size in crossing if i < hi and end >= lo))
            change: dict[int, float] = {}
            for i, end, size in in_memory:
                if lo <= i and end < hi:
                    change[i + 1] = change.get(i + 1, 0.0) + size
                    change[end + 1] = change.get(end + 1, 0.0) - size
            inside = running = 0.0
            for p in sorted(change):
                running += change[p]
                inside = max(inside, running)
            peak = max(peak, live + inside)
        return peak


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
