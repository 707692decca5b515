"""Shared test set-up: GPU tests run only where a CUDA device is present."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

# The build cache would answer a build whose strategies or cost model a test has changed on purpose
# with what an earlier build chose; its own tests (tests/test_build_cache.py) turn it on.
os.environ.setdefault("TECC_BUILD_CACHE", "0")

# The suite never writes the user's caches: one temporary cache directory for the whole session
# (processes the tests start inherit it), removed at the end; the tuning database goes with it.
SESSION_CACHE = tempfile.mkdtemp(prefix="tecc-test-cache-")
os.environ["TECC_CACHE_DIR"] = SESSION_CACHE
os.environ.pop("TECC_TUNING_DB", None)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    shutil.rmtree(SESSION_CACHE, ignore_errors=True)


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


# Property tests: CI runs a fixed, derandomized set of examples so a submission's result does not
# depend on the draw; locally each run explores new ones (HYPOTHESIS_PROFILE=explore for more).
try:
    from hypothesis import settings

    settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
    settings.register_profile("dev", deadline=None, print_blob=True)
    settings.register_profile("explore", deadline=None, max_examples=2000, print_blob=True)
    import os as _os

    settings.load_profile(_os.environ.get("HYPOTHESIS_PROFILE", "ci" if _os.environ.get("CI") else "dev"))
except ImportError:  # hypothesis is a test dependency; without it the property tests are not collected
    pass
