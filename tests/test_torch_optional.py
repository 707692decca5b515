"""torch is an optional dependency: `import tecc` (and building, running) never imports it."""

from __future__ import annotations

import subprocess
import sys


def _python(code: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`code` run by a new Python process (this one's interpreter), its output captured."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)

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
    result = _python(code)
    assert result.returncode == 0, result.stderr


def test_tc_torch_without_torch_says_how_to_install_it() -> None:
    code = (
        "import sys, tecc as tc\n"
        "sys.modules['torch'] = None  # as if torch were not installed\n"
        "try:\n"
        "    tc.torch\n"
        "except ImportError as exc:\n"
        "    assert \"pip install -e '.[torch]'\" in str(exc), exc\n"
        "else:\n"
        "    raise AssertionError('tc.torch imported without torch')\n"
    )
    result = _python(code)
    assert result.returncode == 0, result.stderr[-2000:]


def test_tc_torch_is_the_tecc_torch_module_when_torch_imports(tmp_path) -> None:
    # a stand-in package named torch with just what tecc.torch touches at import time
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text("library = None\nautograd = None\n")
    code = (
        "import tecc as tc\n"
        "module = tc.torch  # through tecc's lazy attribute hook\n"
        "import tecc.torch\n"
        "assert module is tecc.torch and callable(module.op) and callable(module.function)\n"
    )
    env = {**__import__("os").environ, "PYTHONPATH": f"{tmp_path}:{__import__('os').environ.get('PYTHONPATH', '')}"}
    result = _python(code, env)
    assert result.returncode == 0, result.stderr[-2000:]


def test_the_compiler_package_imports_its_names_on_first_use() -> None:
    """tecc.compiler's names come on first use, so its small modules (options, the build cache)
    import without the pipeline; `build` and `explain` stay the functions even when their
    submodules are imported first."""
    code = (
        "import sys\n"
        "from tecc.compiler import build_cache, options\n"
        "assert 'tecc.compiler.planner' not in sys.modules and 'tecc.passes' not in sys.modules\n"
        "import tecc.compiler.build, tecc.compiler.explain  # the submodules first\n"
        "import tecc, tecc.compiler\n"
        "from tecc.compiler import build, explain, load, gpu_available\n"
        "assert callable(build) and build.__module__ == 'tecc.compiler.build', build\n"
        "assert callable(explain) and explain.__module__ == 'tecc.compiler.explain', explain\n"
        "assert tecc.build is build and tecc.compiler.build is build and tecc.explain is explain\n"
        "assert load.__module__ == 'tecc.runtime.artifact' and gpu_available.__module__ == 'tecc.runtime.cuda'\n"
        "assert sys.modules['tecc.compiler.build'].build is build\n"
        "assert set(tecc.compiler.__all__) <= set(dir(tecc.compiler))\n"
        "try:\n"
        "    tecc.compiler.no_such_name\n"
        "except AttributeError:\n"
        "    pass\n"
        "else:\n"
        "    raise AssertionError('no AttributeError')\n"
    )
    result = _python(code)
    assert result.returncode == 0, result.stderr[-2000:]
