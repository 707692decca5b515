"""Where a model's time goes, without a GPU: every kernel tecc would launch for a model's ATen
graphs, with the strategy the planner chose and its predicted time on an architecture, sorted.

    python benchmarks/model_kernels.py                        # GPT-2 small (1 layer), sm_90, top 30
    python benchmarks/model_kernels.py --model gpt2 --layers 12 --top 0      # every kernel
    python benchmarks/model_kernels.py --model convnet --arch sm_80
    python benchmarks/model_kernels.py --model gpt2 --graph backward --explain lm_head_dir/
    python benchmarks/model_kernels.py --partitioner default   # the forward saves what AOTAutograd's default saves
    python benchmarks/model_kernels.py --model resnet50 --roofline --check-build   # + rooflines, generated launches
    python benchmarks/model_kernels.py --model resnet50 --sass   # + each kernel's SASS instruction count

The model's forward and backward graphs are traced as `torch.compile(backend="tecc")` gets them
(AOTAutograd with tecc's decompositions) on CPU tensors at the benchmark's full size
(benchmarks/models.py): the compiled functions only return empty tensors of the traced shapes,
so nothing is computed and nothing large is written. Each graph is then planned as the backend
plans it (tecc.torch.graph.plan_graph, then the planner on each program for `--arch`), without
code generation or NVRTC. A row is one kernel (or one graph-level rewrite that replaces several
kernels: its kernels are listed): the program, its predicted time, the cost model's bound, the
strategy and point, and the FX nodes it computes. The predicted total is the planner's sum, not
a measurement; benchmarks/models.py measures the model on the GPU.

GPT-2 runs under bf16 autocast on the CPU (the GPU benchmark autocasts on CUDA: the same casts;
SDPA traces as its CPU flash-attention op, which tecc lowers as the CUDA ones; only the shape of
the log-sum-exp differs: [B, H, S] here, [B, H, S, 1] from cuDNN's op on an H200). --layers 1 plans
one block (each block's kernels are the same; multiply its rows by 12 for GPT-2 small).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parent / "docs" / "examples"))

from tecc.compiler.planner import PlanResult, plan_program  # noqa: E402
from tecc.ir.tensor import ComputeOp, Tensor  # noqa: E402
from tecc.torch.graph import GraphPlan, plan_graph  # noqa: E402
from tecc.torch.lowering import Sizes  # noqa: E402


# The roofline column's peaks: an H200 (what benchmarks/models_hf.py measures on), which has the
# H100's SMs and clocks (tecc's sm_90 target) and 4.8 TB/s of HBM3e.
ROOF_DRAM = 4.8e12          # bytes/s
ROOF_TENSOR = 989e12        # dense 16-bit tensor-core FLOP/s
ROOF_FP32 = 66.9e12         # FP32 FLOP/s (a contraction that is not on tensor cores, any other kernel)


@dataclass
class Row:
    graph: str
    program: str
    kernels: tuple[str, ...]
    strategy: str
    label: str
    seconds: float
    bound: str
    nodes: list[str]
    kind: str = ""                      # the kernel's shape: elementwise / reduction / contraction, extents
    roof: float = 0.0                   # seconds at the H200's DRAM bandwidth or FLOP peak (0: a group row)
    launch: tuple[int, int, int] = (0, 0, 0)   # the chosen workload's blocks, threads and shared bytes per block


def _roofline(info: Any, on_tensor_cores: bool) -> float:
    from tecc.compiler.cost.traffic import compulsory_bytes

    flops = float(info.flops)
    return max(compulsory_bytes(info) / ROOF_DRAM, flops / (ROOF_TENSOR if on_tensor_cores else ROOF_FP32))


def _shape(info: Any) -> str:
    spatial = "x".join(str(e) for _, e in info.spatial)
    reduce = "x".join(str(e) for _, e in info.reduction)
    return f"{info.kind} [{spatial}]" + (f" / [{reduce}]" if reduce else "")


# ---- tracing: the ATen graphs the backend would get ------------------------------------------------
def _empty_outputs(gm: torch.fx.GraphModule) -> Callable[..., list[Any]]:
    """A stand-in for a compiled graph: empty tensors of the traced outputs' shapes and strides."""
    (out,) = [n for n in gm.graph.nodes if n.op == "output"]

    def run(*_: Any) -> list[Any]:
        vals = [o.meta.get("val") if isinstance(o, torch.fx.Node) else None for o in out.args[0]]
        return [torch.empty_strided(v.shape, v.stride(), dtype=v.dtype) if isinstance(v, torch.Tensor) else None
                for v in vals]

    run._boxed_call = True  # type: ignore[attr-defined]
    return lambda args: run(*args)


def trace(model: torch.nn.Module, inputs: Sequence[torch.Tensor], train: bool,
          autocast: torch.dtype | None, partitioner: str = "recompute",
          kwargs: dict[str, Any] | None = None) -> dict[str, torch.fx.GraphModule]:
    """The forward and backward (or inference) ATen graphs of `model(*inputs, **kwargs)`, split by
    the backend's `partitioner` option (tecc/torch/backend.py). A model that dynamo splits at a
    graph break gives several: the second graph's are `forward1`, `backward1`, ..."""
    from torch._functorch.aot_autograd import aot_module_simplified

    from tecc.torch.backend import lift_constants, partition
    from tecc.torch.decompositions import decomposition_table

    graphs: dict[str, torch.fx.GraphModule] = {}

    count = [0]

    def backend(gm: torch.fx.GraphModule, example: Sequence[Any]) -> Any:
        suffix = str(count[0]) if count[0] else ""
        count[0] += 1

        def keep(kind: str) -> Callable[..., Any]:
            def compiler(g: torch.fx.GraphModule, _: Any) -> Any:
                graphs[kind + suffix] = g
                fn = _empty_outputs(g)
                fn._boxed_call = True  # type: ignore[attr-defined]
                return fn
            return compiler
        return aot_module_simplified(gm, example, fw_compiler=keep("forward"), bw_compiler=keep("backward"),
                                     inference_compiler=keep("inference"), decompositions=decomposition_table(),
                                     **partition(partitioner))

    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend)
    with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None), torch.set_grad_enabled(train):
        out = compiled(*inputs, **(kwargs or {}))
    if train:
        (out.loss if hasattr(out, "loss") else out).backward()
    torch._dynamo.reset()
    for g in graphs.values():   # tensor constants become inputs, as the backend makes them
        lift_constants(g)
    return graphs


def gpt2(layers: int, partitioner: str = "recompute") -> dict[str, torch.fx.GraphModule]:
    """GPT-2 small's training step (benchmarks/models.py): batch 8 x 1024, bf16 autocast, SDPA."""
    from train_gpt import GPT

    torch.manual_seed(0)
    model = GPT(50304, 768, 12, layers, 1024, "sdpa")
    idx = torch.randint(0, 50304, (8, 1024))
    return trace(model, (idx, idx), train=True, autocast=torch.bfloat16, partitioner=partitioner)


def convnet(layers: int, partitioner: str = "recompute") -> dict[str, torch.fx.GraphModule]:
    """benchmarks/models.py's conv net: bf16 channels_last inference, batch 32 at 224 x 224."""
    from torch import nn

    def block(cin: int, cout: int, **kw: Any) -> list[nn.Module]:
        return [nn.Conv2d(cin, cout, bias=False, **kw), nn.BatchNorm2d(cout), nn.ReLU()]

    torch.manual_seed(0)
    body: list[nn.Module] = block(3, 64, kernel_size=7, stride=2, padding=3) + [nn.MaxPool2d(3, 2, 1)]
    for _ in range(layers):
        body += block(64, 64, kernel_size=3, padding=1)
    body += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 1000)]
    cl = torch.channels_last
    model = nn.Sequential(*body).eval().to(torch.bfloat16).to(memory_format=cl)
    x = torch.randn(32, 3, 224, 224, dtype=torch.bfloat16).to(memory_format=cl)
    return trace(model, (x,), train=False, autocast=None)


def hf_gpt2(layers: int, partitioner: str = "recompute") -> dict[str, torch.fx.GraphModule]:
    """benchmarks/models_hf.py's model: transformers' GPT2LMHeadModel(GPT2Config()) with its own
    SDPA attention and loss (`labels=`), batch 8 x 1024, bf16 autocast, dropout 0. transformers is
    not a tecc dependency (PYTHONPATH to an install of it). Its loss is a second graph (a graph
    break in transformers' logging): `forward1` / `backward1`."""
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=layers, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                     attn_implementation="sdpa")
    model = transformers.GPT2LMHeadModel(config).train()
    idx = torch.randint(0, config.vocab_size, (8, 1024))
    return trace(model, (), train=True, autocast=torch.bfloat16, partitioner=partitioner,
                 kwargs={"input_ids": idx, "labels": idx})


def resnet50(layers: int, partitioner: str = "recompute") -> dict[str, torch.fx.GraphModule]:
    """benchmarks/models_hf.py's resnet50 (bf16 channels_last inference, batch 32 at 224 x 224)
    written here as torchvision's architecture (conv 7x7/2, batch norm, relu, max pool 3x3/2,
    Bottleneck stages [3, 4, 6, 3] of widths 64/128/256/512 x 4, the stride on the 3x3 conv, a
    strided 1x1 downsample; average pool, linear): a copy of the architecture for planning on the
    CPU only, since torchvision's wheels do not always load against the installed torch.
    `layers` caps the blocks per stage (0: all)."""
    from torch import nn

    class Bottleneck(nn.Module):
        def __init__(self, cin: int, width: int, stride: int) -> None:
            super().__init__()
            cout = width * 4
            self.conv1, self.bn1 = nn.Conv2d(cin, width, 1, bias=False), nn.BatchNorm2d(width)
            self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
            self.bn2 = nn.BatchNorm2d(width)
            self.conv3, self.bn3 = nn.Conv2d(width, cout, 1, bias=False), nn.BatchNorm2d(cout)
            self.relu = nn.ReLU(inplace=True)
            self.downsample = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout))
                               if stride != 1 or cin != cout else None)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            identity = x if self.downsample is None else self.downsample(x)
            out = self.relu(self.bn1(self.conv1(x)))
            out = self.relu(self.bn2(self.conv2(out)))
            return self.relu(self.bn3(self.conv3(out)) + identity)

    torch.manual_seed(0)
    body: list[nn.Module] = [nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False), nn.BatchNorm2d(64),
                             nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1)]
    cin = 64
    for i, (blocks, width) in enumerate(zip([3, 4, 6, 3], [64, 128, 256, 512])):
        for b in range(min(blocks, layers) if layers else blocks):
            body.append(Bottleneck(cin, width, 2 if b == 0 and i > 0 else 1))
            cin = width * 4
    body += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, 1000)]
    cl = torch.channels_last
    model = nn.Sequential(*body).eval().to(torch.bfloat16).to(memory_format=cl)
    x = torch.randn(32, 3, 224, 224, dtype=torch.bfloat16).to(memory_format=cl)
    return trace(model, (x,), train=False, autocast=None)


MODELS = {"gpt2": gpt2, "convnet": convnet, "hf-gpt2": hf_gpt2, "resnet50": resnet50}


# ---- planning ---------------------------------------------------------------------------------------
def _nodes_by_kernel(plan: GraphPlan, seg_index: int, kernels: Sequence[str]) -> dict[str, list[str]]:
    """kernel -> the FX nodes of the segment whose value it computes (inlined values go to the
    kernels of their readers: tecc.torch.report's rule)."""
    from tecc.torch.report import _consumers, _kernels_of

    seg = plan.segments[seg_index]
    readers = _consumers(seg.args[seg.outputs_start:])
    memo: dict[int, set[str]] = {}
    found: dict[str, list[str]] = {}
    for node in seg.nodes:
        value = seg.values.get(node)
        for t in value if isinstance(value, tuple) else (value,):
            if isinstance(t, Tensor) and isinstance(t.op, ComputeOp):
                for k in _kernels_of(t, kernels, readers, memo):
                    if node.name not in found.setdefault(k, []):
                        found[k].append(node.name)
    return found


def _rows_of(result: PlanResult, graph: str, program: str) -> list[Row]:
    """One row per kernel planned per kernel, one per graph-level rewrite; a plan in regions by
    its parts."""
    if result.parts:
        return [row for part in result.parts for row in _rows_of(part, graph, program)]
    group = result.group
    rows = []
    claimed: set[str] = set()
    if group is not None and group.chosen is not None:
        c = group.chosen
        claimed = set(group.kernels)
        rows.append(Row(graph, program, tuple(group.kernels), c.strategy.name, c.label, c.cost.total, c.cost.bound,
                        []))
    for kp in result.kernels:
        if kp.kernel in claimed:
            continue
        c = kp.chosen
        tensor = c.strategy.name.startswith(("gemm_tensor_core", "gemm_wgmma"))
        w = c.workload
        rows.append(Row(graph, program, (kp.kernel,), c.strategy.name, c.label, c.cost.total, c.cost.bound, [],
                        _shape(kp.info), _roofline(kp.info, tensor), (w.blocks, w.threads, w.smem_bytes)))
    return rows


def plan_model(graphs: dict[str, torch.fx.GraphModule], arch: str, only: str | None = None,
               explain_dir: str | None = None, log: Callable[[str], None] = print) -> tuple[list[Row], list[str]]:
    """Every kernel of the graphs' programs planned for `arch` (module docstring), and the ops
    that would run as ATen."""
    from tecc.compiler.explain import explain

    rows: list[Row] = []
    fallbacks: list[str] = []
    for kind, gm in graphs.items():
        if only and kind != only:
            continue
        start = time.perf_counter()
        plan = plan_graph(gm, kind, Sizes(), set())
        for node in plan.fallbacks:
            fallbacks.append(f"{kind}: {node.name} ({node.target}): {plan.reasons.get(node, '')}")
        for i, seg in enumerate(plan.segments):
            result = plan_program(seg.args, arch, name=seg.name)
            found = _rows_of(result, kind, seg.name)
            names = [k for r in found for k in r.kernels]
            by_kernel = _nodes_by_kernel(plan, i, names)
            for r in found:
                r.nodes = [n for k in r.kernels for n in by_kernel.get(k, [])]
            rows += found
            if explain_dir:
                os.makedirs(explain_dir, exist_ok=True)
                Path(explain_dir, f"{kind}_{seg.name}.txt").write_text(_explain_all(result, explain))
        log(f"# {kind}: {len(plan.segments)} program(s) planned for {arch} in {time.perf_counter() - start:.1f} s")
    return rows, fallbacks


def _explain_all(result: PlanResult, explain: Callable[[PlanResult], str]) -> str:
    if result.parts:
        return "\n\n".join(_explain_all(p, explain) for p in result.parts)
    return explain(result)


def table(rows: list[Row], top: int, scale: float = 1.0) -> str:
    ordered = sorted(rows, key=lambda r: -r.seconds)
    total = sum(r.seconds for r in rows)
    lines = [f"predicted total {total * scale * 1e3:.2f} ms over {len(rows)} kernel(s)"
             + (f" (x{scale:g})" if scale != 1.0 else ""),
             "| # | graph | us | % | bound | strategy (point) | kernel(s) | FX nodes |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for n, r in enumerate(ordered[:top] if top else ordered, 1):
        nodes = ", ".join(r.nodes[:6]) + (f", ... ({len(r.nodes)})" if len(r.nodes) > 6 else "")
        kernels = ", ".join(r.kernels[:3]) + (f", ... ({len(r.kernels)})" if len(r.kernels) > 3 else "")
        lines.append(f"| {n} | {r.graph} | {r.seconds * 1e6:.1f} | {100 * r.seconds / total:.1f} | {r.bound} | "
                     f"{r.label} | {kernels} | {nodes} |")
    by_strategy: dict[str, list[float]] = {}
    for r in rows:
        by_strategy.setdefault(r.strategy, []).append(r.seconds)
    lines.append("")
    lines.append("by strategy: " + "; ".join(
        f"{s} {len(v)} kernel(s) {sum(v) * 1e3:.2f} ms"
        for s, v in sorted(by_strategy.items(), key=lambda kv: -sum(kv[1]))))
    return "\n".join(lines)


def roofline_table(rows: list[Row]) -> str:
    """Every kernel with its shape, the chosen launch, the predicted time against the roofline at
    the H200's peaks (compulsory DRAM bytes / 4.8 TB/s, FLOPs / the tensor-core or FP32 peak),
    largest ratio first: a kernel far above its roofline is where the plan is weak or the model
    wrong (its generated code is the next thing to read: --check-build)."""
    ordered = sorted((r for r in rows if r.roof), key=lambda r: -r.seconds / r.roof)
    lines = ["| kernel | shape (kind [spatial] / [reduced]) | strategy | blocks x threads, smem | predicted us "
             "| roofline us | ratio |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in ordered:
        blocks, threads, smem = r.launch
        lines.append(f"| {r.kernels[0]} | {r.kind} | {r.strategy} | {blocks} x {threads}, {smem / 1024:.1f} KiB | "
                     f"{r.seconds * 1e6:.1f} | {r.roof * 1e6:.1f} | {r.seconds / r.roof:.1f} |")
    return "\n".join(lines)


def check_build(graphs: dict[str, torch.fx.GraphModule], arch: str) -> list[str]:
    """Build every program for `arch` (NVRTC, no GPU) and set each kernel's launch and shared
    memory as generated beside what its chosen point was priced with: a kernel whose grid or
    shared memory differs from the model's is priced for code it does not run (resnet50's
    classifier: 4 KiB of staged rows priced, 130 KiB generated). Returns the lines of a table."""
    from tecc.compiler import build
    from tecc.runtime.host import resolve_launch

    lines = ["| kernel | strategy | modeled blocks x threads, smem | built grid x block, smem | registers, spills | check |",
             "| --- | --- | --- | --- | --- | --- |"]
    for kind, gm in graphs.items():
        plan = plan_graph(gm, kind, Sizes(), set())
        for seg in plan.segments:
            f = build(seg.args, target="cuda", name=seg.name, arch=arch)
            infos = {k.name: k for k in f.host.kernels}
            for kp in _kernel_plans(f.planning):
                info = infos.get(kp.kernel)
                if info is None:
                    continue
                w = kp.chosen.workload
                grid, block = resolve_launch(info, {}, f.host.name)
                res = f.resources.get(info.function)
                built_smem = info.dynamic_smem + (res.shared_bytes if res else 0)
                blocks, threads = grid[0] * grid[1] * grid[2], block[0] * block[1] * block[2]
                flag = []
                if blocks != w.blocks or threads != w.threads:
                    flag.append("launch differs")
                if built_smem > 1.25 * w.smem_bytes + 2048:
                    flag.append(f"shared memory {built_smem / max(w.smem_bytes, 1):.0f}x the model's")
                if res and res.spill_stores:
                    flag.append("spills")
                lines.append(f"| {kp.kernel} | {kp.chosen.strategy.name} | {w.blocks} x {w.threads}, "
                             f"{w.smem_bytes / 1024:.1f} KiB | {grid} x {block}, {built_smem / 1024:.1f} KiB | "
                             f"{res.registers if res else '?'}, {res.spill_stores if res else '?'} | "
                             f"{'; '.join(flag) or 'ok'} |")
    return lines


def sass_counts(graphs: dict[str, torch.fx.GraphModule], arch: str) -> list[str]:
    """Build every program for `arch` (NVRTC, no GPU) and count each kernel's SASS (cuobjdump and
    nvdisasm on PATH, e.g. from the nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm wheels):
    instructions (static: tecc's loops are mostly unrolled), CALLs (IEEE division and square root
    slow paths, one per call site) and MUFU instructions. A kernel far above its predicted time
    whose instructions are mostly not its loads and MMAs is recomputing something (stop 40:
    resnet50's batch norm tails). Returns the lines of a table, or why it cannot."""
    import re
    import shutil
    import subprocess
    import tempfile

    from tecc.compiler import build

    if shutil.which("cuobjdump") is None or shutil.which("nvdisasm") is None:
        return ["--sass needs cuobjdump and nvdisasm on PATH (pip download nvidia-cuda-cuobjdump "
                "nvidia-cuda-nvdisasm; their bin/ folders)"]
    lines = ["| program | kernel | SASS instructions | CALL | MUFU |", "| --- | --- | --- | --- | --- |"]
    for kind, gm in graphs.items():
        plan = plan_graph(gm, kind, Sizes(), set())
        for seg in plan.segments:
            f = build(seg.args, target="cuda", name=seg.name, arch=arch)
            with tempfile.NamedTemporaryFile(suffix=".cubin") as tmp:
                tmp.write(f.cubin)
                tmp.flush()
                sass = subprocess.run(["cuobjdump", "--dump-sass", tmp.name], capture_output=True, text=True,
                                      check=True).stdout
            counts: dict[str, list[int]] = {}
            current = None
            for line in sass.splitlines():
                m = re.search(r"Function : (\S+)", line)
                if m:
                    current = m.group(1)
                    counts[current] = [0, 0, 0]
                elif current is not None and re.match(r"\s+/\*[0-9a-f]{4,6}\*/", line):
                    counts[current][0] += 1
                    counts[current][1] += "CALL" in line
                    counts[current][2] += "MUFU" in line
            for name, (total, calls, mufu) in sorted(counts.items(), key=lambda kv: -kv[1][0]):
                lines.append(f"| {seg.name} | {name} | {total} | {calls} | {mufu} |")
    return lines


def _kernel_plans(result: PlanResult) -> list[Any]:
    if result.parts:
        return [kp for part in result.parts for kp in _kernel_plans(part)]
    claimed = set(result.group.kernels) if result.group is not None and result.group.chosen is not None else set()
    return [kp for kp in result.kernels if kp.kernel not in claimed]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(MODELS), default="gpt2")
    p.add_argument("--layers", type=int, default=None,
                   help="GPT-2 blocks (default 1) / conv layers (default 3) / resnet50 blocks per stage (default 0: all)")
    p.add_argument("--arch", default="sm_90")
    p.add_argument("--graph", default=None, help="only this graph: forward, backward or inference")
    p.add_argument("--top", type=int, default=30, help="rows shown (0: all)")
    p.add_argument("--nodes", default=None, help="print the graphs' FX nodes whose op's name contains this "
                   "(e.g. attention), with their arguments and shapes")
    p.add_argument("--explain", default=None, help="a folder: each program's explain() text")
    p.add_argument("--roofline", action="store_true",
                   help="also every kernel's predicted time against its roofline at the H200's peaks")
    p.add_argument("--check-build", action="store_true",
                   help="also build the programs (NVRTC) and set each kernel's generated launch and shared "
                        "memory beside the model's (minutes for a whole model)")
    p.add_argument("--sass", action="store_true",
                   help="also build the programs and count each kernel's SASS instructions, CALLs and MUFUs "
                        "(cuobjdump and nvdisasm on PATH)")
    p.add_argument("--partitioner", choices=["min_cut", "default", "recompute"], default="recompute",
                   help="what the forward saves for the backward (the backend's option of that name)")
    args = p.parse_args()
    layers = args.layers if args.layers is not None else {"gpt2": 1, "hf-gpt2": 1, "resnet50": 0}.get(args.model, 3)
    start = time.perf_counter()
    graphs = MODELS[args.model](layers, args.partitioner)
    print(f"# {args.model} ({layers} layer(s)) traced in {time.perf_counter() - start:.1f} s: "
          + ", ".join(f"{k} {len(g.graph.nodes)} nodes" for k, g in graphs.items()))
    if args.nodes:
        for kind, gm in graphs.items():
            for node in gm.graph.nodes:
                if node.op == "call_function" and args.nodes in str(node.target):
                    val = node.meta.get("val")
                    shape = [tuple(v.shape) for v in val] if isinstance(val, (tuple, list)) else tuple(getattr(val, "shape", ()))
                    print(f"# {kind}: {node.name} = {node.target}{tuple(str(a) for a in node.args)} {node.kwargs or ''} -> {shape}")
    rows, fallbacks = plan_model(graphs, args.arch, args.graph, args.explain)
    print(table(rows, args.top))
    for line in fallbacks:
        print(f"ATen fallback: {line}")
    if args.roofline:
        print("\n" + roofline_table(rows))
    if args.check_build:
        print("\n" + "\n".join(check_build(graphs, args.arch)))
    if args.sass:
        print("\n" + "\n".join(sass_counts(graphs, args.arch)))


if __name__ == "__main__":
    main()
