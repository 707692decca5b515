"""compile_cuda's ptxas report when the driver's compute cache answers: with a CUDA driver on
the machine, ptxas prints no `-v` report for a cubin it made before (~/.nv/ComputeCache); the
planner's spill and C7515 checks need it, so compile_cuda probes with one unique extra kernel
and keeps the first compile's binary. No GPU here: the cache hit is played by a stub."""

from __future__ import annotations

import dataclasses

import pytest

from tecc.codegen import nvrtc

SOURCE = 'extern "C" __global__ void k(float* x) { x[threadIdx.x] += 1.0f; }\n'


def test_a_compile_without_a_report_is_probed_and_keeps_its_binary(monkeypatch: pytest.MonkeyPatch) -> None:
    try:
        real = nvrtc._compile(SOURCE, arch="sm_80", name="t", options=())
    except Exception as exc:  # noqa: BLE001 - NVRTC not installed: nothing to probe
        pytest.skip(f"NVRTC unavailable: {exc}")
    assert "k" in real.resources
    calls: list[str] = []
    compile_ = nvrtc._compile

    def cached_first(source: str, **kw: object) -> nvrtc.CompiledCode:
        calls.append(source)
        code = real if source == SOURCE else compile_(source, arch="sm_80", name="t", options=())
        # the first compile plays a compute-cache hit: same binary, an empty log
        return dataclasses.replace(code, resources={}, log="") if len(calls) == 1 else code

    monkeypatch.setattr(nvrtc, "_compile", cached_first)
    code = nvrtc.compile_cuda(SOURCE, arch="sm_80", name="t")
    assert len(calls) == 2 and calls[1].startswith(SOURCE) and nvrtc._PROBE_PREFIX in calls[1]
    assert list(code.resources) == ["k"] and code.resources["k"] == real.resources["k"]
    assert code.cubin == real.cubin and code.ptx == real.ptx, "the binary is the first compile's"
    assert nvrtc._PROBE_PREFIX not in code.log and "k" in code.log


def test_a_compile_with_a_report_is_not_probed(monkeypatch: pytest.MonkeyPatch) -> None:
    try:
        real = nvrtc._compile(SOURCE, arch="sm_80", name="t", options=())
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"NVRTC unavailable: {exc}")
    calls: list[str] = []
    monkeypatch.setattr(nvrtc, "_compile", lambda source, **kw: calls.append(source) or real)
    assert nvrtc.compile_cuda(SOURCE, arch="sm_80", name="t") is real and len(calls) == 1
