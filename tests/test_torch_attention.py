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
    the CPU one, whose log-sum-exp [B, H, S] eager lays out as (B, S, H): the program writes it
    in that order (graph.py `_write_order`), a small kernel of its own after the attention's."""
    from tecc.compiler.planner import plan_program

    result = plan_program(_qkv_forward_program(op, 8, 12, 1024, 64), arch)
    if op == "cpu":
        assert result.plan.strategy == "regions", result.plan
        attention, ordered = result.parts
        assert [k.kernel for k in ordered.kernels] == ["getitem_4_ordered_kernel"], ordered.plan
        assert ordered.plan.strategy == "elementwise", ordered.plan
        result = attention
    assert result.plan.strategy == "online_contraction_mma", result.plan
    (step,) = result.plan.steps
    assert step.primitive == "online_contraction_mma" and bool(step.args.get("wgmma")) == (arch == "sm_90"), step


def _index_mask_attention(q, k, v):
    """SDPA with the float causal mask built in the graph from `arange` and `le`, as transformers
    builds it for SDPA under torch.compile: `where(j <= i, 0, -inf)`, [B, 1, S, S]."""
    S = q.shape[-2]
    pos = torch.arange(S)
    keep = (pos[None, None, None, :] <= pos[None, None, :, None]).expand(q.shape[0], -1, S, S)
    mask = torch.where(keep, torch.tensor(0.0, dtype=q.dtype), torch.tensor(float("-inf"), dtype=q.dtype))
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def test_a_float_mask_of_indices_is_the_causal_mask_in_the_emulator():
    """The index-built float mask through the backend (forward and backward, float32, the
    emulator) against float64 eager with the same mask: the scores read `where(j <= i, S, -inf)`,
    no mask stored; gradients too."""
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 3, 24, 16, generator=gen, requires_grad=True) for _ in range(3))
    out = torch.compile(_index_mask_attention, backend="tecc", options={"fallback": "error"})(q, k, v)
    g = torch.randn(out.shape, generator=gen)
    out.backward(g)
    ref = [x.detach().double().requires_grad_() for x in (q, k, v)]
    want = _index_mask_attention(*ref)
    want.backward(g.double())
    scale = want.abs().max().item()
    assert (out.detach().double() - want).abs().max().item() <= 1e-5 * scale
    for x, r in zip((q, k, v), ref):
        assert (x.grad.double() - r.grad).abs().max().item() <= 1e-5 * (r.grad.abs().max().item() + 1e-9)
    torch._dynamo.reset()


def _mask_program(kind: str, S: int, D: int = 64):
    """The SDPA backward op (CPU flash form) under a float mask: `kind` "index" (built from
    arange and le in the graph), "causal" (is_causal=True, no mask) or "data" (a mask input)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    B, H = 2, 4
    q = torch.empty(B, H, S, D, dtype=torch.bfloat16)
    lse = torch.empty(B, H, S, dtype=torch.float32)

    def fn(g, q, k, v, o, lse, data):
        if kind == "index":
            pos = torch.arange(S)
            keep = (pos[None, None, None, :] <= pos[None, None, :, None]).expand(B, -1, S, S)
            mask = torch.where(keep, torch.full((), 0.0, dtype=q.dtype), torch.full((), float("-inf"), dtype=q.dtype))
        else:
            mask = data if kind == "data" else None
        return aten._scaled_dot_product_flash_attention_for_cpu_backward.default(
            g, q, k, v, o, lse, 0.0, kind == "causal", attn_mask=mask, scale=D ** -0.5)

    data = torch.empty(B, 1, S, S, dtype=torch.bfloat16)
    gm = make_fx(fn, tracing_mode="fake")(*(torch.empty_like(q) for _ in range(5)), lse, data)
    plan = plan_graph(gm, "attention_backward", Sizes(), set())
    assert not plan.fallbacks
    (seg,) = plan.segments
    return seg.args


def test_a_float_mask_of_indices_plans_as_the_causal_backward_for_sm_90():
    """transformers' index-built causal mask plans as is_causal's backward does (the masked key
    blocks skipped: the same prediction), reading no mask; a mask that is data is read and
    every block computed (lowering/attention.py, additive_keep)."""
    from tecc.compiler.planner import plan_program

    S = 512
    found = {kind: plan_program(_mask_program(kind, S), "sm_90") for kind in ("index", "causal", "data")}
    assert all(r.plan.strategy.startswith("online_backward") for r in found.values()), \
        {k: r.plan.strategy for k, r in found.items()}
    assert found["index"].predicted_seconds == pytest.approx(found["causal"].predicted_seconds, rel=1e-6)
    assert found["data"].predicted_seconds > 1.2 * found["causal"].predicted_seconds
    reads = {t.name for t in _mask_program("index", S) if t.is_placeholder}
    assert not any("where" in n or "mask" in n for n in reads), reads


def test_additive_keep_takes_only_zero_or_minus_infinity_of_the_indices():
    import math

    import tecc as tc
    from tecc.torch.lowering.attention import additive_keep

    ninf = tc.const(-math.inf, "float32") if hasattr(tc, "const") else -math.inf
    causal = tc.compute((1, 1, 8, 8), lambda b, h, i, j: tc.where(j <= i, 0.0, ninf), name="causal_mask")
    keep = additive_keep(causal)
    assert keep is not None
    b, h, i, j = (tc.var(n) for n in "bhij")
    assert str(keep((b, h, i, j), (2, 4, 8, 8))) == "j <= i"
    data = tc.placeholder((1, 1, 8, 8), "bool", name="data")
    from_data = tc.compute((1, 1, 8, 8), lambda b, h, i, j: tc.where(data[b, h, i, j], 0.0, ninf), name="m2")
    finite = tc.compute((1, 1, 8, 8), lambda b, h, i, j: tc.where(j <= i, 0.0, -1.0), name="m3")
    assert additive_keep(from_data) is None and additive_keep(finite) is None and additive_keep(data) is None


def test_additive_keep_reads_torchs_conversion_of_a_boolean_mask():
    """torch's SDPA hands its fused CUDA ops a boolean mask as where(logical_not(keep), -inf, 0):
    the same keep, the comparison turned around rather than negated."""
    import math

    import tecc as tc
    from tecc.torch.lowering.attention import additive_keep

    pos = tc.compute((8,), lambda i: tc.cast(i, "int64"), name="pos")
    keep = tc.compute((1, 1, 8, 8), lambda b, h, i, j: pos[j] <= pos[i], name="keep")
    bias = tc.compute((1, 1, 8, 8), lambda b, h, i, j: tc.where(~keep[b, h, i, j], -math.inf, 0.0), name="bias")
    found = additive_keep(bias)
    assert found is not None
    b, h, i, j = (tc.var(n) for n in "bhij")
    assert str(found((b, h, i, j), (2, 4, 8, 8))) == "j <= i"


def test_additive_keep_takes_a_finite_stand_in_for_minus_infinity_where_no_row_is_masked_whole():
    """transformers (5.17 on the GPU machine) masks with torch.finfo(float16).min, -65504: taken
    as -inf where the diagonal of the square mask is kept (the causal mask; every row keeps a
    key), not where a row may be masked whole (eager's softmax of such a row is uniform), nor
    for a value near 0."""
    import tecc as tc
    from tecc.torch.lowering.attention import additive_keep

    def mask(cond, value, keys=8):
        return tc.compute((1, 1, 8, keys), lambda b, h, i, j: tc.where(cond(i, j), 0.0, value), name="m")

    b, h, i, j = (tc.var(n) for n in "bhij")
    causal = additive_keep(mask(lambda i, j: j <= i, -65504.0))
    assert causal is not None and str(causal((b, h, i, j), (2, 4, 8, 8))) == "j <= i"
    assert additive_keep(mask(lambda i, j: j < i, -65504.0)) is None          # row 0 masked whole
    assert additive_keep(mask(lambda i, j: j < i, float("-inf"))) is not None
    assert additive_keep(mask(lambda i, j: j <= i, -100.0)) is None
    assert additive_keep(mask(lambda i, j: j <= i, -65504.0, keys=16)) is None   # not square


def test_a_float16_min_mask_of_indices_matches_eager_in_the_emulator():
    """The causal mask at -65504 (transformers' masking value) through the backend against
    float64 eager with the same mask: equal to float32 precision (every masked exp underflows)."""
    def fn(q, k, v):
        S = q.shape[-2]
        pos = torch.arange(S)
        keep = (pos[None, None, None, :] <= pos[None, None, :, None]).expand(q.shape[0], -1, S, S)
        mask = torch.where(keep, torch.tensor(0.0, dtype=q.dtype), torch.tensor(-65504.0, dtype=q.dtype))
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 2, 16, 8, generator=gen, requires_grad=True) for _ in range(3))
    out = torch.compile(fn, backend="tecc", options={"fallback": "error"})(q, k, v)
    out.sum().backward()
    ref = [x.detach().double().requires_grad_() for x in (q, k, v)]
    want = fn(*ref)
    want.sum().backward()
    assert (out.detach().double() - want).abs().max().item() <= 1e-5 * want.abs().max().item()
    for x, r in zip((q, k, v), ref):
        assert (x.grad.double() - r.grad).abs().max().item() <= 1e-5 * (r.grad.abs().max().item() + 1e-9)
    torch._dynamo.reset()
