"""The emulator's semantics of the instruction rows (tecc.ir.instructions), keyed by row name: the
one place that says which runner executes which instruction. Each rule lives beside the state it
works on: cp.async groups in async_copy.py, wgmma's fences and groups and setmaxnreg in
warpgroup.py, mbarriers in mbarrier.py, bulk-store groups and named barriers in bulk_store.py.
A new row needs its rule here (tests/test_instruction_table.py checks every row has one).
"""

from __future__ import annotations

from typing import Callable

from ...ir.errors import TeccError
from ...ir.stmt import Instruction
from . import async_copy, bulk_store, mbarrier, warpgroup
from .expr_compiler import Scope
from .state import LaneState

Runner = Callable[[LaneState], None]

SEMANTICS: dict[str, Callable[[Instruction, Scope], Runner]] = {
    "cp.async.commit_group": async_copy.compile_commit,
    "cp.async.wait_group": async_copy.compile_wait,
    "wgmma.fence": warpgroup.compile_fence,
    "wgmma.commit_group": warpgroup.compile_commit,
    "wgmma.wait_group": warpgroup.compile_wait,
    "fence.proxy.async": warpgroup.compile_proxy_fence,
    "setmaxnreg": warpgroup.compile_set_max_registers,
    "mbarrier.init": mbarrier.compile_init,
    "mbarrier.arrive": mbarrier.compile_arrive,
    "mbarrier.arrive.expect_tx": mbarrier.compile_arrive,
    "mbarrier.try_wait.parity": mbarrier.compile_wait,
    "cp.async.bulk.commit_group": bulk_store.compile_commit,
    "cp.async.bulk.wait_group.read": bulk_store.compile_wait,
    "bar.sync": bulk_store.compile_named_barrier,
    "prefetch.tensormap": bulk_store.compile_prefetch_tensor_map,
}


def compile_instruction(s: Instruction, scope: Scope) -> Runner:
    """The runner of an instruction statement, by its row."""
    rule = SEMANTICS.get(s.name)
    if rule is None:
        raise TeccError(f"kernel {scope.kernel}: the emulator has no semantics for the instruction {s.name}")
    return rule(s, scope)
