"""The README's headline example runs as written, with or without a GPU."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def headline_example() -> str:
    text = README.read_text(encoding="utf-8")
    section = text.split("## Ten lines", 1)[1]
    found = re.search(r"```python\n(.*?)```", section, re.S)
    assert found is not None, "README.md: no python block under '## Ten lines'"
    return found.group(1)


def test_the_readme_headline_example_runs_as_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    exec(compile(headline_example(), str(README), "exec"), {"__name__": "readme"})
    assert "__global__" in capsys.readouterr().out              # print(f.source)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "gemm.cu", "gemm.cubin", "gemm.ir", "gemm.json", "gemm.ptx"]
    assert any((tmp_path / "dumps").iterdir())


def test_a_loaded_artifact_runs_in_the_emulator(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import numpy as np

    import tecc as tc

    monkeypatch.chdir(tmp_path)
    namespace: dict[str, object] = {"__name__": "readme"}
    exec(compile(headline_example(), str(README), "exec"), namespace)
    g = tc.load("out/gemm")
    a, b = namespace["a"], namespace["b"]
    assert isinstance(a, np.ndarray) and isinstance(b, np.ndarray)
    c = np.zeros((100, 512), "float32")
    g.sim(a, b, c)
    np.testing.assert_allclose(c, a @ b, rtol=1e-4)
    if not tc.gpu_available():
        with pytest.raises(tc.DeviceError, match=r"\.sim\(\.\.\.\)"):
            g(a, b, c)
