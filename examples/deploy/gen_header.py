#!/usr/bin/env python3
"""Turn a tecc artifact manifest (OP.json, docs/runtime.md) into a C/C++ header for the driver API.

    python examples/deploy/gen_header.py out/sin_axpb.json -o build/sin_axpb.h

The header needs only <stdint.h> and <stddef.h> (no tecc, no CUDA headers) and gives, for the
module OP (its `entry`):

    OP_ARCH, OP_NUM_LAUNCHES, OP_NUM_ARRAYS, OP_NUM_TEMPS         the facts
    OP_sizes     struct: every size / stride variable (int64_t), filled by the caller
    OP_buffers   struct: the device pointer (uint64_t) of every array argument and temporary
    OP_bytes_<array>(const OP_sizes*)                           bytes of each array and temporary
    OP_launch(int i, const OP_sizes*, const OP_buffers*, tecc_launch*)
        fills launch i: kernel name, grid (evaluated from the manifest's expressions), block,
        dynamic shared memory, and `params`, the kernelParams array for cuLaunchKernel in the
        kernel ABI order (pointers 8 bytes, int32 / int64 sizes by value).
        Returns 0 when launch i has an empty grid and must be skipped (as the tecc runtime does).

It reads the manifest with `json` alone, so it runs where tecc is not installed. It refuses
manifest versions it does not know. Version 2 adds zero-initialised temporaries: the header
says "zero this temporary once" at each (zero it when you allocate it; the kernels keep it zero).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

SUPPORTED_VERSIONS = (1, 2)

C_TYPES = {"float32": "float", "float64": "double", "float16": "uint16_t (half)",
           "bfloat16": "uint16_t (bfloat16)", "int32": "int32_t", "int64": "int64_t", "bool": "uint8_t"}
BYTES = {"float32": 4, "float64": 8, "float16": 2, "bfloat16": 2, "int32": 4, "int64": 8, "bool": 1}
_CMP = {"<", "<=", ">", ">=", "==", "!="}
_ARITH = {"+", "-", "*"}


class HeaderError(Exception):
    pass


def ident(name: str) -> str:
    """A C identifier for a tecc name."""
    out = re.sub(r"[^0-9A-Za-z_]", "_", name)
    return out if out and not out[0].isdigit() else f"_{out}"


def c_expr(j: Any, names: dict[str, str]) -> str:
    """A manifest expression (tecc.ir.serialize) as C over int64_t variables `names[var]`."""
    if "const" in j:
        v = j["const"]
        if isinstance(v, bool):
            return "1" if v else "0"
        if isinstance(v, int):
            return f"INT64_C({v})"
        raise HeaderError(f"floating constant {v} in a launch expression")
    if "var" in j:
        if j["var"] not in names:
            raise HeaderError(f"launch expression uses {j['var']}, which no size or parameter defines")
        return names[j["var"]]
    if "op" in j:
        a, b = (c_expr(x, names) for x in j["args"])
        op = j["op"]
        if op in _ARITH:
            return f"({a} {op} {b})"
        if op == "//":
            return f"tecc_floordiv({a}, {b})"
        if op == "%":
            return f"tecc_floormod({a}, {b})"
        if op in ("min", "max"):
            return f"tecc_{op}({a}, {b})"
        if op in ("&", "|", "^"):
            return f"({a} {op} {b})"
        raise HeaderError(f"operator {op!r} in a launch expression")
    if "cmp" in j:
        a, b = (c_expr(x, names) for x in j["args"])
        if j["cmp"] not in _CMP:
            raise HeaderError(f"comparison {j['cmp']!r}")
        return f"(int64_t)({a} {j['cmp']} {b})"
    if "not" in j:
        return f"(int64_t)(!{c_expr(j['not'], names)})"
    if "cast" in j:
        return c_expr(j["arg"], names)
    if "select" in j:
        c, a, b = (c_expr(x, names) for x in j["select"])
        return f"({c} ? {a} : {b})"
    raise HeaderError(f"cannot translate {json.dumps(j)} to C")


def _var_names(j: Any, out: dict[str, str]) -> None:
    """Every variable (name -> dtype) in an expression."""
    if isinstance(j, dict):
        if "var" in j:
            out.setdefault(j["var"], j["dtype"])
        for v in j.values():
            _var_names(v, out)
    elif isinstance(j, list):
        for v in j:
            _var_names(v, out)


def generate(manifest: dict[str, Any], source_name: str = "") -> str:
    if manifest.get("format") != "tecc-artifact":
        raise HeaderError("not a tecc artifact manifest (format is not 'tecc-artifact')")
    if manifest.get("version") not in SUPPORTED_VERSIONS:
        raise HeaderError(f"manifest version {manifest.get('version')} is not one this generator reads "
                          f"({SUPPORTED_VERSIONS}); update examples/deploy/gen_header.py")
    host = manifest["host"]
    op = ident(manifest["entry"])
    P = op.upper()
    arrays = [p["buffer"] for p in host["params"] if "buffer" in p]
    temps = [t["buffer"] for t in host["temps"]]
    sizes: dict[str, str] = {}
    for p in host["params"]:
        if "scalar" in p:
            sizes.setdefault(p["scalar"]["var"], p["scalar"]["dtype"])
    _var_names([b["shape"] + (b["strides"] or []) for b in arrays + temps], sizes)
    size_c = {name: f"s->{ident(name)}" for name in sizes}

    L: list[str] = []
    w = L.append
    w(f"/* Generated by examples/deploy/gen_header.py from {source_name or 'a tecc manifest'}")
    w(f" * (tecc-artifact version {manifest['version']}, tecc {manifest.get('versions', {}).get('tecc', '?')}).")
    w(" * Do not edit: regenerate it when the artifact changes. */")
    w(f"#ifndef TECC_{P}_H")
    w(f"#define TECC_{P}_H")
    w("#include <stddef.h>\n#include <stdint.h>\n")
    w("#ifndef TECC_LAUNCH_DEFINED\n#define TECC_LAUNCH_DEFINED")
    w("#define TECC_MAX_PARAMS 64")
    w("typedef union { uint64_t ptr; int32_t i32; int64_t i64; } tecc_arg;")
    w("typedef struct {")
    w("    const char *kernel;              /* extern \"C\" name in the cubin (cuModuleGetFunction) */")
    w("    unsigned grid[3], block[3];      /* cuLaunchKernel's gridDim and blockDim */")
    w("    unsigned shared_bytes;           /* dynamic shared memory (sharedMemBytes) */")
    w("    int num_params;")
    w("    tecc_arg values[TECC_MAX_PARAMS];")
    w("    void *params[TECC_MAX_PARAMS];   /* kernelParams: params[i] points at values[i] */")
    w("} tecc_launch;")
    w("/* Python's floor division and modulo (the IR's // and %), exact for negative operands too. */")
    w("static inline int64_t tecc_floordiv(int64_t a, int64_t b) { int64_t q = a / b; "
      "return (q * b != a && ((a < 0) != (b < 0))) ? q - 1 : q; }")
    w("static inline int64_t tecc_floormod(int64_t a, int64_t b) { return a - tecc_floordiv(a, b) * b; }")
    w("static inline int64_t tecc_min(int64_t a, int64_t b) { return a < b ? a : b; }")
    w("static inline int64_t tecc_max(int64_t a, int64_t b) { return a > b ? a : b; }")
    w("#endif\n")
    w(f'#define {P}_ENTRY "{manifest["entry"]}"')
    w(f'#define {P}_ARCH "{manifest["arch"]}"')
    w(f'#define {P}_SOURCE_SHA256 "{manifest.get("source_sha256", "")}"')
    w(f"#define {P}_NUM_LAUNCHES {len(host['calls'])}")
    w(f"#define {P}_NUM_ARRAYS {len(arrays)}")
    w(f"#define {P}_NUM_TEMPS {len(temps)}\n")

    w("/* Array arguments, in the kernel signature's order (what tecc.build was given):")
    for i, b in enumerate(arrays):
        shape = ", ".join(_pretty(s) for s in b["shape"])
        strides = f", strides ({', '.join(_pretty(s) for s in b['strides'])})" if b["strides"] else ", contiguous"
        w(f" *   {i}: {b['name']}: {b['dtype']}[{shape}]{strides}")
    for b in temps:
        w(f" *   temporary {b['name']}: {b['dtype']}[{', '.join(_pretty(s) for s in b['shape'])}] "
          "(allocate it; tecc's runtime does)")
        if b.get("zero_init"):
            # version 2: a self-resetting counter (split_reduce's arrivals); tecc's runtime zeroes it
            # when it allocates it and never again
            w(" *     zero this temporary once, when you allocate it (cuMemsetD8 to 0) and before its first launch;")
            w(" *     the kernels leave it zero, so reuse it across calls without zeroing it again")
    w(f" * Outputs: {', '.join(host['outputs']) or '(none)'}. */\n")

    w(f"/* Sizes and strides (in elements) of the arrays; set every field before {op}_launch. */")
    w("typedef struct {")
    for name, dtype in sizes.items():
        where = _binding(name, arrays)
        w(f"    int64_t {ident(name)};  /* {dtype}{'; ' + where if where else ''} */")
    if not sizes:
        w("    int64_t unused_;")
    w(f"}} {op}_sizes;\n")

    w("/* Device pointers (CUdeviceptr) of the arrays and temporaries, 16-byte aligned. */")
    w("typedef struct {")
    for b in arrays:
        w(f"    uint64_t {ident(b['name'])};  /* {C_TYPES.get(b['dtype'], b['dtype'])} */")
    for b in temps:
        zero = "; zero this temporary once, when allocated" if b.get("zero_init") else ""
        w(f"    uint64_t {ident(b['name'])};  /* temporary, {C_TYPES.get(b['dtype'], b['dtype'])}{zero} */")
    w(f"}} {op}_buffers;\n")

    for b in arrays + temps:
        count = " * ".join(f"(size_t)({c_expr(s, size_c)})" for s in b["shape"]) or "(size_t)1"
        w(f"static inline size_t {op}_bytes_{ident(b['name'])}(const {op}_sizes *s) "
          f"{{ (void)s; return {count} * {BYTES[b['dtype']]}; }}")
    w("")

    w(f"/* Fill launch i (0 <= i < {P}_NUM_LAUNCHES) for these sizes and buffers; launch them in order on")
    w(" * one stream. Returns 0 when the grid is empty (skip the launch), 1 otherwise, -1 for a bad i. */")
    w(f"static inline int {op}_launch(int i, const {op}_sizes *s, const {op}_buffers *buf, tecc_launch *out) {{")
    w("    (void)s; (void)buf;")
    w("    switch (i) {")
    buffer_names = {b["name"] for b in arrays + temps}
    for i, call in enumerate(host["calls"]):
        kernel = next(k for k in host["kernels"] if k["name"] == call["kernel"])
        w(f"    case {i}: {{  /* {kernel['name']}({', '.join(call['args'])}) */")
        local: dict[str, str] = dict(size_c)
        for param, arg in zip(kernel["params"], call["args"]):
            if "scalar" in param:
                var = param["scalar"]["var"]
                local[var] = f"v_{ident(var)}"
                w(f"        const int64_t v_{ident(var)} = s->{ident(arg)}; (void)v_{ident(var)};")
        w(f'        out->kernel = "{kernel["name"]}";')
        for axis, g in enumerate(kernel["grid"]):
            w(f"        int64_t g{axis} = {c_expr(g, local)};")
        w("        if (g0 <= 0 || g1 <= 0 || g2 <= 0) return 0;")
        w("        out->grid[0] = (unsigned)g0; out->grid[1] = (unsigned)g1; out->grid[2] = (unsigned)g2;")
        bx, by, bz = kernel["block"]
        w(f"        out->block[0] = {bx}; out->block[1] = {by}; out->block[2] = {bz};")
        w(f"        out->shared_bytes = {int(kernel.get('dynamic_smem', 0))};")
        w(f"        out->num_params = {len(call['args'])};")
        for n, (param, arg) in enumerate(zip(kernel["params"], call["args"])):
            if "buffer" in param:
                if arg not in buffer_names:
                    raise HeaderError(f"launch {kernel['name']} passes {arg}, which is no array or temporary")
                w(f"        out->values[{n}].ptr = buf->{ident(arg)};")
            else:
                dtype = param["scalar"]["dtype"]
                field = {"int32": "i32", "int64": "i64"}.get(dtype)
                if field is None:
                    raise HeaderError(f"scalar parameter of dtype {dtype}")
                cast = "int32_t" if field == "i32" else "int64_t"
                w(f"        out->values[{n}].{field} = ({cast})s->{ident(arg)};")
        w("        break;")
        w("    }")
    w("    default: return -1;")
    w("    }")
    w("    for (int p = 0; p < out->num_params; ++p) out->params[p] = &out->values[p];")
    w("    return 1;")
    w("}\n")
    w(f"#endif /* TECC_{P}_H */")
    return "\n".join(L) + "\n"


def _pretty(j: Any) -> str:
    if "const" in j:
        return str(j["const"])
    if "var" in j:
        return j["var"]
    if "op" in j:
        return f"({_pretty(j['args'][0])} {j['op']} {_pretty(j['args'][1])})"
    return "?"


def _binding(name: str, arrays: list[dict[str, Any]]) -> str:
    """Where a size variable can be read from: the first array dimension or stride that is it."""
    for b in arrays:
        for d, s in enumerate(b["shape"]):
            if s.get("var") == name:
                return f"= {b['name']}.shape[{d}]"
        for d, s in enumerate(b["strides"] or []):
            if s.get("var") == name:
                return f"= {b['name']}.strides[{d}] (elements)"
    return ""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Write a C/C++ header with the launch configuration of a tecc artifact.")
    p.add_argument("manifest", help="the artifact's .json (or its stem)")
    p.add_argument("-o", "--output", help="the header to write (default: stdout)")
    args = p.parse_args(argv)
    path = Path(args.manifest)
    if path.suffix != ".json":
        path = path.with_suffix(".json")
    try:
        manifest = json.loads(path.read_text())
        text = generate(manifest, path.name)
    except (OSError, ValueError, KeyError, HeaderError) as exc:
        print(f"gen_header: error: {path}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    if args.output:
        out = Path(args.output)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
