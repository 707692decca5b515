"""torch is an optional dependency: `import tecc` (and building, running) never imports it."""

from __future__ import annotations

import subprocess
import sys


def test_importing_and_using_tecc_does_not_import_torch() -> None:
    code = (
        "import sys, numpy as np, tecc as tc\n"
        "X = tc.placeholder((4,), 'float32', name='X')\n"
        "Y = tc.compute((4,), lambda i: X[i] * 2.0, name='Y')\n"
        "g = tc.grad(Y, [X])\n"
        "y = tc.build([X, Y], target='sim')(np.ones(4, np.float32))\n"
        "assert (y == 2).all()\n"
        "import tecc.runtime.cuda, tecc.runtime.outputs, tecc.compiler\n"
        "assert 'torch' not in sys.modules, 'tecc imported torch'\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
