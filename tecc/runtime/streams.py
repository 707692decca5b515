"""Which CUDA stream a call of the executor runs on (docs/runtime.md, "Streams, synchronization, errors").

An executor made with a stream launches on it. One made without (`stream=None`) follows its
producers: a call whose device arrays are all torch tensors launches on torch's current stream
(the first tensor's; nothing to wait for, and capturable in a CUDA graph), any other call on the
device's default stream. The legacy default stream has two handles, NULL and CU_STREAM_LEGACY,
which name one stream (`same_stream`).

The stream objects are cuda.core's, imported when first needed.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..ir.errors import TeccError
from . import arrays

# The two handles of the legacy default stream: NULL (0, what torch's default stream reports)
# and CU_STREAM_LEGACY (1, cuda.core's `default_stream`, and DLPack's number for it).
LEGACY_DEFAULT_STREAMS = (0, 1)
CU_STREAM_LEGACY = 1

# Followed producer streams remembered per executor (cuda.core Stream views of their handles).
FOLLOWED_STREAMS = 64


def same_stream(a: int, b: int) -> bool:
    """Whether CUstream handles `a` and `b` name one stream (so work on it is already ordered)."""
    return a == b or (a in LEGACY_DEFAULT_STREAMS and b in LEGACY_DEFAULT_STREAMS)


def followed_producer(args: tuple[Any, ...]) -> int | None:
    """The position of the argument whose current stream a following executor's call runs on:
    the first torch CUDA tensor, when every device argument is one (host arrays aside); None
    when another producer's device array is among them (the call runs on the executor's own
    stream) or there is no torch tensor."""
    found = None
    for pos, arg in enumerate(args):
        if type(arg) is np.ndarray:
            continue
        if arrays.current_stream_reader(arg) is not None:
            found = pos if found is None else found
        elif not arrays.is_host_array(arg):
            return None  # another producer's device array: its own ordering, on our stream
    return found


def as_stream(stream: Any, device: Any) -> Any:
    """The cuda.core Stream for the executor's `stream=` argument (None: the device's default
    stream; a Stream; an object with `__cuda_stream__`; a torch.cuda.Stream; a CUstream handle)."""
    from cuda.core import Stream

    if stream is None:
        return device.default_stream
    if isinstance(stream, Stream):
        return stream
    if hasattr(stream, "__cuda_stream__"):
        return device.create_stream(stream)
    handle = getattr(stream, "cuda_stream", stream)  # torch.cuda.Stream exposes its handle as .cuda_stream
    if isinstance(handle, int):
        return Stream.from_handle(handle)
    raise TeccError(
        f"cannot use a {type(stream).__name__} as a CUDA stream: pass a cuda.core Stream, an object with "
        "__cuda_stream__, a torch.cuda.Stream or a CUstream handle (int)"
    )


__all__ = ["CU_STREAM_LEGACY", "FOLLOWED_STREAMS", "LEGACY_DEFAULT_STREAMS", "as_stream", "followed_producer",
           "same_stream"]
