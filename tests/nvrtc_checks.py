"""Whether NVRTC is here, for the tests that compile generated CUDA without a GPU (a helper
module: importing it skips nothing)."""

from __future__ import annotations

import pytest


def nvrtc_available(arch: str | None = None) -> bool:
    """NVRTC loads (and, with `arch`, compiles for that architecture)."""
    try:
        from tecc.codegen import nvrtc_version
        from tecc.codegen.nvrtc import supported_archs

        nvrtc_version()
        return arch is None or arch in supported_archs()
    except Exception:  # noqa: BLE001 - no NVRTC library on this machine
        return False


def skip_without_nvrtc(arch: str = "sm_90") -> None:
    """Skip the calling test unless NVRTC compiles for `arch`."""
    if not nvrtc_available(arch):
        pytest.skip(f"NVRTC is not available or cannot compile for {arch}")


needs_nvrtc = pytest.mark.skipif(not nvrtc_available(), reason="NVRTC is not available")
