"""Patching a cached call's CUDA graph for new pointers (docs/runtime.md, "Patching graphs for new
pointers"; on by default, `TECC_CUDA_GRAPHS=patch`; `1` turns it off).

A graph captured for one set of pointers (graphs.py) writes exactly there. A training loop with
torch's caching allocator often gives a call's outputs and gradients new addresses every call, so
an exact-pointer graph never replays and every kernel is launched from Python. Instead, the graph
is kept per cached call and, when a call's pointers differ from the ones the graph holds, only the
kernel nodes whose parameters take a changed pointer are given new parameters
(`cuGraphExecKernelNodeSetParams`), and the graph is launched:

- **Which nodes**: `pointer_users` lists, for each pointer index (the arguments', then the
  followed-stream temporaries'), the launches whose parameters take it, as a pointer or as a
  tensor map of it; `changed_launches` is the union over the pointers that differ. Scalars,
  grids and executor-owned temporaries are fixed per cached call (a new temporary clears the
  cache), so nothing else can change.
- **The new parameters**: each launch's parameters are packed once when the graph is captured
  (`tensor_map.PackedParameters`, the same bytes the capture passed); a patch writes the changed
  pointers (and re-encoded tensor maps) into those buffers in place and hands the node the same
  `kernelParams` array. The driver copies the parameters during the call, so the buffers may be
  written again at the next patch while the graph still runs.
- **Why per node, never a re-capture and `cuGraphExecUpdate`**: a re-capture submits every
  launch again from Python (what a plain launch costs) before the update walks the whole graph;
  setting the changed nodes' parameters costs one driver call per changed node, fewer calls than
  either for any number of changed nodes.
- **The mapping** from launches to nodes (`kernel_nodes`): the captured graph must be one chain
  of kernel nodes, one per launch, in launch order (what one stream's capture of kernel launches
  makes), each with the launch's function, grid, block and shared memory. Anything else (a
  memset or memcpy node, a fork onto another stream, a node of another function) makes the graph
  unpatchable: the call keeps its exact-pointer graphs and launches plainly otherwise
  (`GraphStats.unpatchable`, with the reason in `unpatchable_why`).

The decisions (`pointer_users`, `changed_launches`, `chain_order`, `NodePatch.patch`) are pure
Python on packed bytes; `kernel_nodes` and `set_node_params` call the driver through cuda.bindings.
"""

from __future__ import annotations

import ctypes
from typing import Any, Callable, Sequence

from ..ir.errors import LaunchError
from .tensor_map import TENSOR_MAP_BYTES, PackedParameters


def pointer_users(launches: Sequence[Any], pointers: int) -> tuple[tuple[int, ...], ...]:
    """For each of the call's `pointers` (indices as `CachedLaunch.array_slots` and `map_slots`
    name them), the positions of the launches whose parameters take it, in launch order."""
    users: list[list[int]] = [[] for _ in range(pointers)]
    for position, launch in enumerate(launches):
        indices = {index for _, index in launch.array_slots}
        indices.update(index for _, index, *_ in launch.map_slots)
        for index in sorted(indices):
            users[index].append(position)
    return tuple(tuple(u) for u in users)


def changed_launches(users: Sequence[Sequence[int]], old: Sequence[int], new: Sequence[int]) -> list[int]:
    """The launches (positions, ascending) whose parameters differ between pointer sets `old`
    and `new`: those taking a pointer that changed."""
    changed: set[int] = set()
    for index, (was, now) in enumerate(zip(old, new)):
        if was != now:
            changed.update(users[index])
    return sorted(changed)


def chain_order(nodes: Sequence[int], edges: Sequence[tuple[int, int]]) -> list[int] | str:
    """`nodes` in dependency order when the edges (from, to) make them one chain (each node
    after exactly one other but the first, none followed by two): the graph one stream's capture
    makes. Otherwise why not."""
    after: dict[int, int] = {}
    before: dict[int, int] = {}
    known = set(nodes)
    for source, target in edges:
        if source not in known or target not in known:
            return "an edge to a node outside the graph"
        if source in after:
            return "a node with two dependents (work forked onto another stream)"
        if target in before:
            return "a node with two dependencies (work joined from another stream)"
        after[source] = target
        before[target] = source
    roots = [n for n in nodes if n not in before]
    if len(roots) != 1:
        return f"{len(roots)} nodes without a dependency (independent work in the graph)"
    order = [roots[0]]
    while order[-1] in after and len(order) <= len(nodes):
        order.append(after[order[-1]])
    if len(order) != len(nodes):
        return "a dependency cycle"
    return order


class NodePatch:
    """What patching one instantiated graph needs: its kernel nodes in launch order, each
    node's parameter structure (CUDA_KERNEL_NODE_PARAMS, pointing at that launch's packed
    parameters), the packed parameters, `users` (`pointer_users`) and the pointers the graph
    holds now."""

    __slots__ = ("nodes", "node_params", "packed", "users", "ptrs")

    def __init__(self, nodes: Sequence[Any], node_params: Sequence[Any], packed: Sequence[PackedParameters],
                 users: tuple[tuple[int, ...], ...], ptrs: Sequence[int]) -> None:
        if not len(nodes) == len(node_params) == len(packed):
            raise LaunchError(f"graph patching: {len(nodes)} nodes, {len(node_params)} parameter sets and "
                              f"{len(packed)} packed launches do not match")
        self.nodes = list(nodes)
        self.node_params = list(node_params)
        self.packed = list(packed)
        self.users = users
        self.ptrs = tuple(ptrs)
        for params, packed_params in zip(self.node_params, self.packed):
            params.kernelParams = packed_params.address
            params.extra = 0

    def patch(self, launches: Sequence[Any], ptrs: Sequence[int],
              tensor_map: Callable[[Any, int, tuple[int, ...], tuple[int, ...]], Any],
              set_params: Callable[[Any, Any], None]) -> int:
        """Give the graph the parameters of `launches` for `ptrs`: the changed pointers (and
        the tensor maps of them, `tensor_map(spec, pointer, shape, strides)` encoding one)
        written into the packed parameters of the launches that take them, and each of those
        nodes handed them (`set_params(node, node_params)`). Returns how many nodes changed.
        Raises what `set_params` raises; the graph is then half patched and must be dropped."""
        changed = changed_launches(self.users, self.ptrs, ptrs)
        for position in changed:
            launch, packed = launches[position], self.packed[position]
            for pos, index in launch.array_slots:
                packed.storage[pos].value = int(ptrs[index])
            for pos, index, spec, shape, strides in launch.map_slots:
                encoded = tensor_map(spec, ptrs[index], shape, strides)
                ctypes.memmove(packed.pointers[pos], encoded.data, TENSOR_MAP_BYTES)
            set_params(self.nodes[position], self.node_params[position])
        self.ptrs = tuple(ptrs)
        return len(changed)


# ---- the driver ----------------------------------------------------------------------------------

def _listed(result: tuple[Any, ...], what: str) -> tuple[Any, ...]:
    """A listing call's result (cuda.bindings: the error first, the count last; CUDA 13 adds
    edge data between), checked."""
    from cuda.bindings import driver

    if result[0] != driver.CUresult.CUDA_SUCCESS:
        raise LaunchError(f"{what} failed: {getattr(result[0], 'name', result[0])}")
    return result


def kernel_handles(kernel_handle: Any) -> set[int]:
    """The handles a graph node of this cuda.core kernel (a CUkernel) may name: the kernel, and
    its function in the current context (cuKernelGetFunction), when the driver gives one."""
    from cuda.bindings import driver

    handles = {int(kernel_handle)}
    try:
        err, function = driver.cuKernelGetFunction(driver.CUkernel(int(kernel_handle)))
        if err == driver.CUresult.CUDA_SUCCESS:
            handles.add(int(function))
    except Exception:  # noqa: BLE001 - an older driver or a handle of another kind: the kernel alone
        pass
    return handles


def kernel_nodes(source: Any, expected: Sequence[tuple[set[int], tuple[int, ...], tuple[int, ...], int]]
                 ) -> tuple[list[Any], list[Any]] | str:
    """The kernel nodes of the captured (source) graph in launch order, with their parameter
    structures, each checked against the launch `expected` there: (the handles its function may
    have, grid, block, dynamic shared bytes). Or why the graph cannot be patched."""
    from cuda.bindings import driver

    count = int(_listed(driver.cuGraphGetNodes(source, 0), "cuGraphGetNodes")[-1])
    if count != len(expected):
        return f"{count} graph nodes for {len(expected)} launches"
    nodes = list(_listed(driver.cuGraphGetNodes(source, count), "cuGraphGetNodes")[1])[:count]
    by_handle = {int(node): node for node in nodes}
    edges: list[tuple[int, int]] = []
    if count > 1:
        edge_count = int(_listed(driver.cuGraphGetEdges(source, 0), "cuGraphGetEdges")[-1])
        listed = _listed(driver.cuGraphGetEdges(source, edge_count), "cuGraphGetEdges")
        edges = [(int(a), int(b)) for a, b in list(zip(listed[1], listed[2]))[:edge_count]]
    order = chain_order(list(by_handle), edges)
    if isinstance(order, str):
        return order
    params = []
    for position, (handle, want) in enumerate(zip(order, expected)):
        node = by_handle[handle]
        err, kind = driver.cuGraphNodeGetType(node)
        if err != driver.CUresult.CUDA_SUCCESS or kind != driver.CUgraphNodeType.CU_GRAPH_NODE_TYPE_KERNEL:
            return f"node {position} is a {getattr(kind, 'name', kind)} node, not a kernel launch"
        err, node_params = driver.cuGraphKernelNodeGetParams(node)
        if err != driver.CUresult.CUDA_SUCCESS:
            return f"node {position}: cuGraphKernelNodeGetParams failed: {getattr(err, 'name', err)}"
        why = node_mismatch(node_params, want)
        if why:
            return f"node {position} {why}"
        params.append(node_params)
    return [by_handle[h] for h in order], params


def node_mismatch(node_params: Any, want: tuple[set[int], tuple[int, ...], tuple[int, ...], int]) -> str:
    """Why a kernel node's parameters are not those of the launch `want` (see `kernel_nodes`),
    or "" when they are."""
    handles, grid, block, smem = want
    named = {int(node_params.func), int(node_params.kern)} - {0}
    if not named & handles:
        return "launches another function"
    got_grid = (int(node_params.gridDimX), int(node_params.gridDimY), int(node_params.gridDimZ))
    got_block = (int(node_params.blockDimX), int(node_params.blockDimY), int(node_params.blockDimZ))
    if got_grid != tuple(grid) or got_block != tuple(block) or int(node_params.sharedMemBytes) != smem:
        return (f"has grid {got_grid}, block {got_block}, {int(node_params.sharedMemBytes)} shared bytes; "
                f"the launch has {tuple(grid)}, {tuple(block)}, {smem}")
    return ""


def node_setter(graph_exec: Any) -> Callable[[Any, Any], None]:
    """`set(node, node_params)`: cuGraphExecKernelNodeSetParams on `graph_exec`, so that the
    node's next launches take `node_params` (copied by the driver during the call). The driver
    function is looked up once per patch, not per node."""
    from cuda.bindings import driver

    set_params, ok = driver.cuGraphExecKernelNodeSetParams, driver.CUresult.CUDA_SUCCESS

    def set_node(node: Any, node_params: Any) -> None:
        (err,) = set_params(graph_exec, node, node_params)
        if err != ok:
            raise LaunchError(f"cuGraphExecKernelNodeSetParams failed: {getattr(err, 'name', err)}")

    return set_node


__all__ = ["NodePatch", "chain_order", "changed_launches", "kernel_handles", "kernel_nodes", "node_mismatch",
           "node_setter", "pointer_users"]
