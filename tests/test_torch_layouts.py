"""Values crossing a compiled graph's program boundary in eager's layout (tecc/torch/graph.py,
`boundary_order` in lowering/context.py): a dense permutation of a row-major tensor whose last
dimension is not of stride 1 (a transposed matrix: the activation a weight's gradient reads as
X^T) is read by the program in its memory order, passed permuted and not copied; a program's
output eager lays out that way is written in that order. Compared with float64 eager on CPU
tensors (the emulator)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from torch_models import fresh_dynamo, programs  # noqa: E402,F401  (tests/torch_models.py)
from tecc.torch.lowering.context import boundary_order  # noqa: E402


def compiled(fn):
    return torch.compile(fn, backend="tecc", options={"fallback": "error"})


def test_boundary_orders():
    assert boundary_order(torch.empty(32, 64).t()) == (1, 0)
    assert boundary_order(torch.empty(2, 3, 4).permute(0, 2, 1)) == (0, 2, 1)
    assert boundary_order(torch.empty(2, 3, 4, 5).permute(0, 2, 3, 1)) == (0, 3, 1, 2)
    assert boundary_order(torch.empty(1, 64, 32).transpose(1, 2)) == (0, 2, 1)  # size-1 dims outermost
    assert boundary_order(torch.empty(2, 3, 4, 5).to(memory_format=torch.channels_last)) == (0, 2, 3, 1)
    assert boundary_order(torch.empty(64, 32)) is None            # row-major
    assert boundary_order(torch.empty(8, 4)[:, :2]) is None        # rows contiguous: strides read in place
    assert boundary_order(torch.empty(64, 64)[:, :32].t()) is None  # not dense: made contiguous
    assert boundary_order(torch.empty(4, 1).t()) is None           # contiguous (a size-1 dimension)
    assert boundary_order(torch.empty(0, 3).t()) is None


def test_a_transposed_input_is_passed_permuted_not_copied(programs, monkeypatch):
    torch.manual_seed(0)
    x, w = torch.randn(24, 40), torch.randn(24, 16)
    copies = []
    contiguous = torch.Tensor.contiguous

    def counted(t, *args, **kwargs):
        if not t.is_contiguous():
            copies.append(tuple(t.shape))
        return contiguous(t, *args, **kwargs)

    fn = compiled(lambda xt, w: torch.tanh(xt @ w))  # xt: [40, 24], X^T as a weight's gradient reads it
    monkeypatch.setattr(torch.Tensor, "contiguous", counted)
    y = fn(x.t(), w)
    monkeypatch.setattr(torch.Tensor, "contiguous", contiguous)
    torch.testing.assert_close(y.double(), torch.tanh(x.double().t() @ w.double()), rtol=1e-5, atol=1e-5)
    (program,) = programs
    assert program.input_orders[0] == (1, 0) and program.contiguous == (True, True)
    assert copies == [], copies


def test_an_output_eager_lays_out_transposed_is_written_so():
    torch.manual_seed(1)
    x = torch.randn(3, 17, 12)

    def fn(x):
        return torch.sigmoid(x.transpose(1, 2)) * 3  # eager keeps x's memory order: [3, 12, 17] laid out (0, 2, 1)

    y = compiled(fn)(x)
    want = fn(x.double())
    torch.testing.assert_close(y.double(), want, rtol=1e-6, atol=1e-6)
    assert y.stride() == fn(x).stride() == (204, 1, 12), y.stride()


def test_a_transposed_input_then_given_contiguous_is_still_right():
    """Dynamo guards on strides: the contiguous call compiles again (or is copied in its memory
    order where the layout was not guarded); either way the result is eager's."""
    torch.manual_seed(2)
    a, b = torch.randn(20, 30), torch.randn(20, 8)
    fn = compiled(lambda at, b: at @ b)
    torch.testing.assert_close(fn(a.t(), b), a.t() @ b, rtol=1e-5, atol=1e-5)
    c = a.t().contiguous()
    torch.testing.assert_close(fn(c, b), c @ b, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch has no CUDA")
def test_a_transposed_bf16_operand_on_tensor_cores(programs):
    """X^T @ dY as a weight's gradient computes it (bf16, 4096 tokens, width 768 -> 3072): the
    transposed activation read in its memory order by the tensor-core GEMM, not copied."""
    torch.manual_seed(3)
    x = torch.randn(4096, 768, device="cuda").bfloat16()
    dy = torch.randn(4096, 3072, device="cuda").bfloat16()
    f = compiled(lambda xt, dy: xt @ dy)
    f(x.t(), dy)  # compiled; the next call's output comes from the cache the poison was freed into
    torch.empty(768 * 3072, dtype=torch.bfloat16, device="cuda").fill_(float("nan"))
    dw = f(x.t(), dy)
    want = x.double().t() @ dy.double()
    err = float((dw.double() - want).abs().max() / want.abs().max())
    assert err < 2 ** -7, err
    (program,) = programs
    assert program.input_orders[0] == (1, 0)
