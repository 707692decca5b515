"""The backward of scaled dot-product attention from torch.compile(backend="tecc") reaches the
FlashAttention-2 form (tecc/compiler/strategies/online_backward.py): the lowering of
`_scaled_dot_product_*_attention_backward` writes P = exp(S - lse) with the scores inside it, so
the planner takes it as the tensor-core backward (a pre-pass, the key-block kernel, dQ's
conversion) and no (rows x keys) buffer is stored; inside a whole model's backward program too.
Built for sm_80 and sm_90 with NVRTC (no GPU); the numbers of the same programs on the emulator
are the GPT tests' (tests/test_torch_backend.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import tecc  # noqa: E402
from tecc.torch.graph import plan_graph  # noqa: E402
from tecc.torch.lowering import Sizes  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from torch_models import GPT  # noqa: E402

aten = torch.ops.aten


def _square_temps(kernel, rows: int, keys: int) -> list[str]:
    """The temporaries of the built program shaped (batch, heads, rows, keys)."""
    found = []
    for b in kernel.module.temps:
        dims = [int(str(d)) if str(d).isdigit() else None for d in b.shape]
        if len(dims) == 4 and dims[-2:] == [rows, keys]:
            found.append(b.name)
    return found


def _op_program(B: int, H: int, S: int, D: int, causal: bool, op: str = "cpu"):
    from torch.fx.experimental.proxy_tensor import make_fx

    q = torch.empty(B, H, S, D, dtype=torch.bfloat16)
    # cuDNN's log-sum-exp is [B, H, S, 1]; the CPU flash op's [B, H, S]
    lse = torch.empty(B, H, S, *((1,) if op == "cudnn" else ()), dtype=torch.float32)

    def fn(g, q, k, v, o, lse):
        if op == "cudnn":
            none = torch.empty(())
            return aten._scaled_dot_product_cudnn_attention_backward.default(
                g, q, k, v, o, lse, none, none, None, None, None, S, S, 0.0, causal, scale=D ** -0.5)[:3]
        return aten._scaled_dot_product_flash_attention_for_cpu_backward.default(g, q, k, v, o, lse, 0.0, causal,
                                                                                 scale=D ** -0.5)

    gm = make_fx(fn, tracing_mode="fake")(*(torch.empty_like(q) for _ in range(5)), lse)
    plan = plan_graph(gm, "attention_backward", Sizes(), set())
    assert not plan.fallbacks
    (seg,) = plan.segments
    return seg.args


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_the_sdpa_backward_op_is_the_flash_attention_2_backward(arch, causal):
    S = 256
    f = tecc.build(_op_program(2, 4, S, 64, causal), target="cuda", arch=arch)
    names = [k.name for k in f.module.kernels]
    assert f.plan.strategy.startswith("online_backward"), f.explain()
    assert len(names) <= 3, names
    assert _square_temps(f, S, S) == [], [(b.name, b.shape) for b in f.module.temps]


def test_the_cudnn_backward_reads_its_four_dimensional_log_sum_exp_as_a_staged_row_statistic():
    """cuDNN's forward saves lse as [B, H, S, 1], read at [b, h, i, 0]: the same row statistic
    as the CPU op's [B, H, S] one, staged per block of query rows. Read per element from global
    memory instead, the tiles lost their whole-tile forms: in GPT-2's step (bf16, B 8, H 12, S
    1024) the key-block kernel ran 214 µs against 63 µs for the same algebra with a 3-D lse
    (stop 36). The two ops' kernels are the same CUDA, names aside."""
    sources = []
    for op, name in (("cudnn", "_scaled_dot_product_cudnn_attention_backward"),
                     ("cpu", "_scaled_dot_product_flash_attention_for_cpu_backward")):
        f = tecc.build(_op_program(2, 4, 256, 64, True, op), target="cuda", arch="sm_90")
        assert f.plan.strategy == "online_backward_mma", f.explain()
        sources.append(f.source.replace(name, "OP"))
    assert sources[0] == sources[1]


def _gpt_backward_graph(attention: str, context: int):
    """The ATen backward graph AOTAutograd gives tecc for the tiny GPT in bfloat16."""
    from torch._functorch.aot_autograd import aot_module_simplified

    from tecc.torch.decompositions import decomposition_table

    graphs = {}

    def backend(gm, inputs):
        def keep(kind):
            def compiler(g, _):
                graphs[kind] = g
                return g
            return compiler
        return aot_module_simplified(gm, inputs, fw_compiler=keep("forward"), bw_compiler=keep("backward"),
                                     decompositions=decomposition_table())

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = GPT(attention=attention, context=context, heads=2).to(torch.bfloat16)
    idx = torch.randint(0, 128, (2, context))
    torch.compile(model, backend=backend)(idx, idx).backward()
    torch._dynamo.reset()
    return graphs["backward"]


def test_the_tiny_gpt_sdpa_backward_program_reaches_the_flash_attention_2_form():
    S = 64
    gm = _gpt_backward_graph("sdpa", S)
    plan = plan_graph(gm, "gpt_backward", Sizes(), set())
    assert not plan.fallbacks
    (seg,) = plan.segments
    f = tecc.build(seg.args, target="cuda", arch="sm_90")
    names = [k.name for k in f.module.kernels]
    # one tensor-core backward per layer (its pre-pass, key-block kernel and dQ conversion)
    assert sum("backward_mma" in n for n in names) == 2, names
    assert _square_temps(f, S, S) == [], [(b.name, b.shape) for b in f.module.temps]


def test_the_bf16_gpt_trains_through_the_flash_attention_2_backward_in_the_emulator():
    """The same backward program run (the emulator runs the tensor-core kernels): gradients within
    bfloat16 noise of a float32 model's, as eager's bfloat16 ones are."""
    import copy

    from tecc.torch.report import clear_reports, reports

    torch._dynamo.reset()
    clear_reports()
    torch.manual_seed(0)
    model = GPT(attention="sdpa", context=64, heads=2).to(torch.bfloat16)
    reference = copy.deepcopy(model).float()
    idx = torch.randint(0, 128, (2, 64))
    targets = torch.randint(0, 128, (2, 64))
    loss = torch.compile(model, backend="tecc", options={"fallback": "error"})(idx, targets)
    loss.backward()
    torch._dynamo.reset()
    want = reference(idx, targets)
    want.backward()
    assert abs(loss.item() - want.item()) <= 2e-2 * abs(want.item())
    for p, r in zip(model.parameters(), reference.parameters()):
        scale = r.grad.abs().max().item() + 1e-6
        assert (p.grad.float() - r.grad).abs().max().item() <= 3e-2 * scale
    kernels = [k for rep in reports() if rep.name.endswith("backward") for _, names in rep.programs for k in names]
    assert sum("backward_mma" in k for k in kernels) == 2, kernels


def _qkv_forward_program(op: str, B: int, H: int, S: int, D: int):
    """The SDPA forward over GPT-2's views of one fused projection (split(C), view, permute), as
    the op the GPU runs (cuDNN's, log-sum-exp [B, H, S, 1]) or the CPU one ([B, H, S]), traced on
    the meta device (no data)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    C = H * D

    def fn(x):
        q, k, v = (t.view(B, S, H, D).permute(0, 2, 1, 3) for t in x.view(B, S, 3 * C).split(C, dim=2))
        if op == "cudnn":
            return aten._scaled_dot_product_cudnn_attention.default(q, k, v, None, True, 0.0, True, False,
                                                                    scale=D ** -0.5)[:2]
        return aten._scaled_dot_product_flash_attention_for_cpu.default(q, k, v, 0.0, True, scale=D ** -0.5)

    gm = make_fx(fn, tracing_mode="fake")(torch.empty(B * S, 3 * C, dtype=torch.bfloat16, device="meta"))
    plan = plan_graph(gm, f"qkv_{op}", Sizes(), set())
    assert not plan.fallbacks
    (seg,) = plan.segments
    return seg.args


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("op", ["cudnn", "cpu"])
def test_gpt2_sdpa_forward_over_qkv_views_plans_on_tensor_cores(op, arch):
    """GPT-2 small's attention (B 8, H 12, S 1024, d 64, bf16, causal) reads q, k, v as views of
    the QKV GEMM's output: one tensor-core kernel for the target (wgmma on sm_90), the views read
    in place (no copy kernel), for cuDNN's op (its log-sum-exp [B, H, S, 1] a row output) and
    the CPU one."""
    from tecc.compiler.planner import plan_program

    result = plan_program(_qkv_forward_program(op, 8, 12, 1024, 64), arch)
    assert result.plan.strategy == "online_contraction_mma", result.plan
    (step,) = result.plan.steps
    assert step.primitive == "online_contraction_mma" and bool(step.args.get("wgmma")) == (arch == "sm_90"), step
