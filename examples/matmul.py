"""C[i, j] = Σ_k A[i, k] · B[k, j] with a symbolic M."""

import tecc as tc

M, N, K = tc.var("M"), 512, 256
A = tc.placeholder((M, K), "float32", name="A")
B = tc.placeholder((K, N), "float32", name="B")
k = tc.reduce_axis(K, name="k")
C = tc.compute((M, N), lambda i, j: tc.sum(A[i, k] * B[k, j], axis=k), name="C")

OPS = [tc.OpSpec("matmul", [A, B, C], lambda a, b: a @ b, sizes={"M": 100})]
