"""torch.compile(backend="tecc") of convolutions: aten.convolution and its backward lowered as
tensor expressions (tecc/torch/lowering/convolution.py), compared with float64 eager on CPU
tensors (the emulator) for strides, paddings, dilations, groups and 1-/2-/3-d convolutions at odd
sizes; channels_last tensors read and written in their memory order; a transposed convolution
falling back to ATen; and the plan of a padded fp16 NHWC 3x3 layer on sm_90 and sm_80: implicit
GEMMs on tensor cores (NVRTC only, no GPU)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

import tecc  # noqa: E402
from torch_models import fresh_dynamo, programs  # noqa: E402,F401  (tests/torch_models.py)
from tecc.torch.report import reports  # noqa: E402


def compiled(fn, **options):
    return torch.compile(fn, backend="tecc", options={"fallback": "error", **options})


CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}

# (dims, batch, in channels, out channels, input size, kernel, stride, padding, dilation, groups, bias)
GEOMETRIES = [
    pytest.param(2, 2, 3, 5, (7, 9), (3, 3), 1, 1, 1, 1, True, id="2d-3x3-padded"),
    pytest.param(2, 1, 4, 6, (9, 8), (3, 2), (2, 1), (1, 0), 1, 2, False, id="2d-strided-groups"),
    pytest.param(2, 2, 3, 4, (9, 7), (3, 3), 1, 2, 2, 1, True, id="2d-dilated"),
    pytest.param(2, 1, 4, 4, (6, 5), (3, 3), 2, 1, 1, 4, True, id="2d-depthwise-strided"),
    pytest.param(1, 2, 3, 5, (11,), (4,), 2, 3, 1, 1, True, id="1d"),
    pytest.param(3, 1, 2, 3, (5, 4, 3), (3, 2, 1), 1, (1, 0, 0), 1, 1, False, id="3d"),
]


@pytest.mark.parametrize("dims,n,cin,cout,size,kernel,stride,padding,dilation,groups,bias", GEOMETRIES)
def test_convolution_and_its_backward_match_float64_eager(dims, n, cin, cout, size, kernel, stride, padding,
                                                         dilation, groups, bias):
    torch.manual_seed(dims * 7 + cin)
    x = torch.randn(n, cin, *size, requires_grad=True)
    w = torch.randn(cout, cin // groups, *kernel, requires_grad=True)
    b = torch.randn(cout, requires_grad=True) if bias else None
    conv = CONV[dims]

    def fn(x, w, b):
        return conv(x, w, b, stride=stride, padding=padding, dilation=dilation, groups=groups)

    y = compiled(fn)(x, w, b)
    leaves = [x, w] + ([b] if bias else [])
    wide = [t.detach().double().requires_grad_() for t in leaves]
    want = fn(wide[0], wide[1], wide[2] if bias else None)
    torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(y)
    y.backward(g)
    want.backward(g.double())
    for got, ref in zip(leaves, wide):
        torch.testing.assert_close(got.grad.double(), ref.grad, rtol=1e-4, atol=1e-4)
    assert {op for r in reports() for op in r.fallback_ops} == set()


def test_bfloat16_convolution_sums_in_float32_and_rounds_once():
    torch.manual_seed(3)
    x = torch.randn(2, 8, 7, 7).bfloat16()
    w = torch.randn(6, 8, 3, 3).bfloat16()
    b = torch.randn(6).bfloat16()
    y = compiled(lambda x, w, b: F.conv2d(x, w, b, padding=1))(x, w, b)
    assert y.dtype == torch.bfloat16
    want = F.conv2d(x.double(), w.double(), b.double(), padding=1)
    # one rounding of the float32 sum: within half a bfloat16 ulp of the exact result (plus the
    # float32 accumulation's few ulps)
    torch.testing.assert_close(y.double(), want, rtol=2 ** -8, atol=1e-3)


def test_channels_last_is_read_and_written_in_its_memory_order(programs):
    torch.manual_seed(5)
    cl = torch.channels_last
    x = torch.randn(2, 8, 6, 5).to(memory_format=cl)
    w = torch.randn(4, 8, 3, 3).to(memory_format=cl)
    b = torch.randn(4)

    def fn(x, w, b):
        return torch.relu(F.conv2d(x, w, b, padding=1)) * 2

    y = compiled(fn)(x, w, b)
    want = fn(x.double(), w.double(), b.double())
    torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-5)
    assert y.is_contiguous(memory_format=cl) and not y.is_contiguous()   # eager's layout
    (program,) = programs
    # the NHWC input and filter are passed permuted (a view), neither made contiguous in NCHW
    orders = dict(zip(program.inputs, program.input_orders))
    assert sorted(o for o in orders.values() if o is not None) == [(0, 2, 3, 1), (0, 2, 3, 1)]
    assert x.permute(0, 2, 3, 1).is_contiguous() and y.permute(0, 2, 3, 1).is_contiguous()
    assert program.output_orders == ((0, 2, 3, 1),)
    # the convolution, its bias, relu and scale are one kernel (the epilogue), no copy kernel
    kernels = [k for r in reports() for _, names in r.programs for k in names]
    assert len(kernels) == 1, kernels


def test_a_transposed_convolution_falls_back_to_aten_and_is_named_under_fallback_error():
    torch.manual_seed(6)
    x, w = torch.randn(1, 3, 5, 5), torch.randn(3, 2, 3, 3)

    def fn(x, w):
        return F.conv_transpose2d(x, w) + 1

    y = torch.compile(fn, backend="tecc")(x, w)
    torch.testing.assert_close(y, fn(x, w), rtol=1e-5, atol=1e-5)
    (report,) = reports()
    nodes = dict(report.fallbacks["aten.convolution.default"])
    assert "transposed" in next(iter(nodes.values()))
    torch._dynamo.reset()
    with pytest.raises(Exception, match="aten.convolution.default"):
        compiled(fn)(x, w)


# ---- the plan on the GPU (NVRTC only) --------------------------------------------------------------
def _resnet_layer_programs(backward: bool) -> list[list]:
    """The tecc programs of the padded 3x3 layer (batch 32, 56x56, 64 -> 64, fp16 NHWC), forward
    or backward, from the ATen graph that AOTAutograd would give (traced with fake tensors)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from tecc.torch.graph import plan_graph
    from tecc.torch.lowering import Sizes

    aten = torch.ops.aten
    cl = torch.channels_last
    x = torch.empty(32, 64, 56, 56, dtype=torch.float16).to(memory_format=cl)
    w = torch.empty(64, 64, 3, 3, dtype=torch.float16).to(memory_format=cl)
    if backward:
        def fn(g, x, w):
            return aten.convolution_backward.default(g, x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1,
                                                     [True, True, False])
        inputs = (torch.empty_like(x), x, w)
    else:
        def fn(x, w):
            return aten.convolution.default(x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)
        inputs = (x, w)
    gm = make_fx(fn, tracing_mode="fake")(*inputs)
    plan = plan_graph(gm, "resnet_layer", Sizes(), set())
    assert not plan.fallbacks
    return [seg.args for seg in plan.segments]


@pytest.mark.parametrize("arch", ["sm_90", "sm_80"])
@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward"])
def test_the_padded_fp16_nhwc_layer_is_an_implicit_gemm_on_tensor_cores(arch, backward):
    (args,) = _resnet_layer_programs(backward)
    f = tecc.build(args, target="cuda", arch=arch)
    chosen = {kp.kernel: kp.chosen.strategy.name for kp in f.planning.kernels}
    assert len(chosen) == (2 if backward else 1), chosen
    # forward, input gradient and filter gradient: each a tensor-core GEMM over the NHWC view
    # (wgmma or mma.sync), its padding a guarded load; never the generic reduction
    assert all(s in ("gemm_tensor_core", "gemm_wgmma") for s in chosen.values()), f.explain()
    assert f.planning.predicted_seconds < 300e-6, f.explain()


@pytest.mark.parametrize("cin,wide", [(3, 4), (1, 2), (5, 8)])
def test_few_input_channels_are_read_through_a_padded_copy(programs, monkeypatch, cin, wide):
    """A 16-bit convolution of few input channels (resnet's RGB stem: 3) reads its input and
    filters through channels-last copies padded with zeros to the next cp.async size
    (convolution.py `_padded_channels`): two small kernels before the convolution's, the same
    result (the zeros add nothing)."""
    from tecc.torch.lowering import convolution

    monkeypatch.setattr(convolution, "PAD_CHANNELS_MIN_ELEMENTS", 64)  # the emulator's sizes
    torch.manual_seed(cin)
    cl = torch.channels_last
    x = torch.randn(2, cin, 11, 9).bfloat16().to(memory_format=cl)
    w = torch.randn(8, cin, 7, 7).bfloat16().to(memory_format=cl)

    def fn(x, w):
        return torch.relu(F.conv2d(x, w, stride=2, padding=3))

    y = compiled(fn)(x, w)
    want = fn(x.double(), w.double())
    torch.testing.assert_close(y.double(), want, rtol=2 ** -7, atol=2e-2 * float(want.abs().max()) * 2 ** -7)
    kernels = sorted(k for r in reports() for _, names in r.programs for k in names)
    assert kernels == ["convolution_channels_kernel", "convolution_filters_kernel", "relu_kernel"], kernels
    (program,) = programs
    # the padded copies are the program's temporaries (its arguments are still x, w and y),
    # channels-last with `wide` channels
    assert len(program.inputs) == 2 and len(program.outputs) == 1
    temps = {b.name: tuple(int(n) for n in b.shape) for b in program.kernel.module.temps}
    assert temps == {"convolution_channels": (2, 11, 9, wide), "convolution_filters": (8, 7, 7, wide)}, temps


def test_few_channels_below_the_size_threshold_are_read_in_place():
    torch.manual_seed(1)
    x = torch.randn(1, 3, 6, 6).bfloat16()
    w = torch.randn(4, 3, 3, 3).bfloat16()
    y = compiled(lambda x, w: F.conv2d(x, w, padding=1))(x, w)
    torch.testing.assert_close(y.double(), F.conv2d(x.double(), w.double(), padding=1), rtol=2 ** -7, atol=5e-2)
    kernels = [k for r in reports() for _, names in r.programs for k in names]
    assert kernels == ["convolution_kernel"], kernels


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch has no CUDA")
def test_resnet_stem_on_the_gpu_reads_padded_channels(programs):
    """resnet50's stem at its size (bf16, channels_last, 32x3x224x224, 7x7 stride 2): the
    padded channel copies and the implicit GEMM's 8-byte copies on the GPU, against float64."""
    torch.manual_seed(7)
    cl = torch.channels_last
    x = torch.randn(32, 3, 224, 224, device="cuda").bfloat16().to(memory_format=cl)
    w = (torch.randn(64, 3, 7, 7, device="cuda") * 0.1).bfloat16().to(memory_format=cl)

    def fn(x, w):
        return torch.relu(F.conv2d(x, w, stride=2, padding=3))

    f = compiled(fn)
    f(x, w)  # compiled; the next call's output comes from the cache the poison was freed into
    torch.empty(32 * 64 * 112 * 112, dtype=torch.bfloat16, device="cuda").fill_(float("nan"))
    y = f(x, w)
    want = fn(x.double(), w.double())
    err = float((y.double() - want).abs().max() / want.abs().max())
    assert err < 2 ** -7, err
    kernels = sorted(k for r in reports() for _, names in r.programs for k in names)
    assert kernels == ["convolution_channels_kernel", "convolution_filters_kernel", "relu_kernel"], kernels
