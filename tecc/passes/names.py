"""Fresh names: the one rule every pass uses to pick a name that is not taken yet."""

from __future__ import annotations

import re


def identifier(name: str) -> str:
    """`name` made an ASCII C identifier (other characters become `_`; a leading digit gets a
    prefix). ASCII, not Python's Unicode word characters: islpy and NVRTC read these names."""
    out = re.sub(r"[^A-Za-z0-9_]", "_", name)
    return out if out and not out[0].isdigit() else f"t_{out}"


def fresh_name(base: str, taken: set[str], sep: str = "") -> str:
    """`base` as an identifier, or `base{sep}1`, `base{sep}2`, ... : the first not in `taken`,
    which is then added to `taken`."""
    name = identifier(base)
    cand, n = name, 0
    while cand in taken:
        n += 1
        cand = f"{name}{sep}{n}"
    taken.add(cand)
    return cand
