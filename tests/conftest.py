"""Shared test set-up: GPU tests run only where a CUDA device is present."""

from __future__ import annotations

import pytest


def _gpu_present() -> bool:
    try:
        from tecc.runtime.cuda import cuda_available
    except Exception:  # the runtime module itself could not be imported: no usable CUDA stack
        return False
    return bool(cuda_available())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _gpu_present():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none present)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
