"""tecc.codegen: loop-nest IR -> CUDA C (`emit_source`) -> PTX and cubin through NVRTC
(`compile_cuda`), with the ptxas resource report of every kernel. Imports only `tecc.ir`."""

from .cuda import dynamic_shared_bytes, emit_kernel, emit_parts, emit_source, needed_headers, needs_64bit_indexing
from .twins import distinct_source, twin_entries
from .nvrtc import (
           CompiledCode,
           KernelResources,
           compile_cuda,
           default_arch,
           nvrtc_version,
)

__all__ = ["dynamic_shared_bytes", "distinct_source", "emit_kernel", "emit_parts", "emit_source", "twin_entries", "needed_headers", "needs_64bit_indexing", "CompiledCode",
           "KernelResources", "compile_cuda", "default_arch", "nvrtc_version"]
