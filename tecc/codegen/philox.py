"""`RandomUniform` (tc.rand) in CUDA C: the Philox4x32-10 device functions, and the sharing of one
Philox call among the four elements of a counter group.

A RandomUniform node prints as `tecc_rand_uniform(seed, offset, n)`: one full Philox4x32-10
(10 rounds, each two 32x32->64-bit multiplies `__umulhi` / `*` and two three-way XORs) of the
counter offset + (n >> 2), of which word n & 3 is kept. The other three words are exactly the
neighbours n ^ 1, n ^ 2, n ^ 3 of the same group, so where one thread computes all four, one
call serves them:

  In a `vectorize` loop of width 4 or 8 that codegen emits as vector accesses
  (tecc/codegen/vectorize.py), a RandomUniform whose seed and offset do not depend on the lane
  and whose index is `base + lane` with `base` provably a multiple of 4 (`ranges.divisible_by`)
  gets one `const uint4 rand = tecc_rand_group(seed, tecc_rand_counter(offset, base) + g);`
  per group g of four lanes, before the lanes; lane k reads `tecc_uniform(rand.xyzw[k % 4])`.

That is the elementwise strategy's shape for a tensor whose innermost extent is a multiple of 4
(dropout on a float32 tensor: one call per float4; bfloat16: two per 8-element access). Elsewhere
(a scalar schedule, an innermost extent that is not a multiple of 4, a read inside a reduction
loop) each element makes its own call: correct, four times the integer work. Both forms compute
what tecc/ir/philox.py defines, bit for bit, which the emulator runs.
"""

from __future__ import annotations

RAND_HELPER = "tecc_rand_uniform"  # the name `used_intrinsics` reports for a kernel with a RandomUniform
HELPER_NAMES = ("tecc_philox4x32_10", "tecc_uniform", "tecc_rand_counter", "tecc_rand_group", RAND_HELPER)
WORDS = "xyzw"

DEVICE_HELPERS = (
    "// tc.rand (tecc/ir/philox.py): element n of the stream (seed, offset) is word n & 3 of\n"
    "// Philox4x32-10 (Salmon et al., SC'11; Random123's philox4x32_R(10, ...)) of the counter\n"
    "// offset + (n >> 2) under the key seed, mapped as (x >> 8) * 2^-24.\n"
    "__device__ __forceinline__ uint4 tecc_philox4x32_10(uint4 counter, uint2 key) {\n"
    "  unsigned int c0 = counter.x, c1 = counter.y, c2 = counter.z, c3 = counter.w, k0 = key.x, k1 = key.y;\n"
    "  #pragma unroll\n"
    "  for (int round = 0; round < 10; ++round) {\n"
    "    if (round > 0) {  // the key schedule: Weyl increments, modulo 2^32\n"
    "      k0 += 0x9E3779B9u;\n"
    "      k1 += 0xBB67AE85u;\n"
    "    }\n"
    "    const unsigned int hi0 = __umulhi(0xD2511F53u, c0), lo0 = 0xD2511F53u * c0;\n"
    "    const unsigned int hi1 = __umulhi(0xCD9E8D57u, c2), lo1 = 0xCD9E8D57u * c2;\n"
    "    c0 = hi1 ^ c1 ^ k0;\n"
    "    c1 = lo1;\n"
    "    c2 = hi0 ^ c3 ^ k1;\n"
    "    c3 = lo0;\n"
    "  }\n"
    "  return make_uint4(c0, c1, c2, c3);\n"
    "}\n"
    "__device__ __forceinline__ float tecc_uniform(unsigned int x) {\n"
    "  return static_cast<float>(x >> 8) * 5.9604644775390625e-08f;  // 2^-24; exact, x >> 8 < 2^24\n"
    "}\n"
    "__device__ __forceinline__ unsigned long long tecc_rand_counter(long long offset, long long n) {\n"
    "  // offset + floor(n / 4) modulo 2^64 (n >> 2 shifts arithmetically), in unsigned arithmetic:\n"
    "  // the carry from the low word into the high one, and no signed overflow\n"
    "  return static_cast<unsigned long long>(offset) + static_cast<unsigned long long>(n >> 2);\n"
    "}\n"
    "__device__ __forceinline__ uint4 tecc_rand_group(long long seed, unsigned long long counter) {\n"
    "  // counter (lo32, hi32, 0, 0), key (lo32(seed), hi32(seed))\n"
    "  const unsigned long long key = static_cast<unsigned long long>(seed);\n"
    "  return tecc_philox4x32_10(make_uint4(static_cast<unsigned int>(counter), static_cast<unsigned int>(counter >> 32), 0u, 0u),\n"
    "                            make_uint2(static_cast<unsigned int>(key), static_cast<unsigned int>(key >> 32)));\n"
    "}\n"
    "__device__ __forceinline__ float tecc_rand_uniform(long long seed, long long offset, long long n) {\n"
    "  const uint4 r = tecc_rand_group(seed, tecc_rand_counter(offset, n));\n"
    "  const int word = static_cast<int>(n & 3);\n"
    "  return tecc_uniform(word == 0 ? r.x : word == 1 ? r.y : word == 2 ? r.z : r.w);\n"
    "}\n")


def rand_uniform_call(seed: str, offset: str, index: str) -> str:
    """One element: a whole Philox call, one word kept."""
    return f"{RAND_HELPER}({seed}, {offset}, {index})"


def group_call(seed: str, offset: str, base: str, group: int) -> str:
    """The four words of the counter group `group` after the one of element `base` (a multiple
    of 4): the uint4 that lanes 4*group .. 4*group + 3 of a vector loop read."""
    counter = f"tecc_rand_counter({offset}, {base})"
    if group:
        counter += f" + {group}ull"
    return f"tecc_rand_group({seed}, {counter})"


def lane_value(register: str, lane: int) -> str:
    """Lane `lane` of a vector loop, read from the uint4 of its group."""
    return f"tecc_uniform({register}.{WORDS[lane % 4]})"
