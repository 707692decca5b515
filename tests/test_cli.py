"""The `tecc` command: help, compile (cached), run/check, explain, tune, cache, and its errors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tecc.cli import main, parser

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


@pytest.fixture(autouse=True)
def _isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TECC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("TECC_PROGRESS", "0")
    monkeypatch.delenv("TECC_NO_CACHE", raising=False)


def _write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


GOOD = """
import numpy as np
import tecc as tc
n = tc.var("n")
x = tc.placeholder((n,), "float32", name="x")
y = tc.compute((n,), lambda i: x[i] * 2.0, name="y")
OPS = [tc.OpSpec("double", [x, y], lambda x: {ref}, sizes={{"n": 1000}})]
"""


def test_help_lists_every_command_and_the_ops_convention(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for command in ("compile", "check", "run", "explain", "tune", "cache"):
        assert command in out
    assert "OPS = [tc.OpSpec(" in out and "TECC_CACHE_DIR" in out and "Exit status" in out
    for command in ("compile", "run", "explain", "tune", "cache"):
        text = parser()._subparsers._group_actions[0].choices[command].format_help()  # type: ignore[union-attr]
        assert "usage: tecc " + command in text


def test_compile_writes_artifacts_and_the_second_run_is_cached(tmp_path: Path, capsys) -> None:
    out = tmp_path / "out"
    assert main(["compile", str(EXAMPLES / "matmul.py"), "--arch", "sm_90", "-o", str(out),
                 "--dump-ir", str(tmp_path / "dumps")]) == 0
    first = capsys.readouterr().out
    assert "matmul" in first and "cache" not in first.splitlines()[0], first
    assert "from earlier builds: 0 plan(s) from the build cache, 0 cubin(s) from the compile cache" in first
    for suffix in (".cubin", ".ptx", ".cu", ".json"):
        assert (out / f"matmul{suffix}").exists()
    assert (tmp_path / "dumps" / "matmul" / "00_lower.txt").exists()
    assert main(["compile", str(EXAMPLES / "matmul.py"), "--arch", "sm_90"]) == 0
    second = capsys.readouterr().out  # (the suite turns the build cache off: the op is planned again)
    assert second.splitlines()[0].endswith(" (cubin from the compile cache)"), second
    assert "0 plan(s) from the build cache, 1 cubin(s) from the compile cache" in second


def test_compile_says_what_it_reused_and_never_claims_a_cache_on_an_empty_one(
        tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TECC_BUILD_CACHE", "1")
    argv = ["compile", str(EXAMPLES / "conv.py"), str(EXAMPLES / "elementwise.py"), "--arch", "sm_90"]
    assert main(argv) == 0  # an empty cache: the planner's ptxas check compiles the conv kernels
    first = capsys.readouterr().out.splitlines()
    conv = [line for line in first if line.startswith("conv3x3")]
    assert len(conv) == 2 and all(line.endswith(" (cubin compiled once, by the planner's ptxas check)")
                                  for line in conv), first
    assert [line for line in first if line.startswith("sin_axpb")][0].endswith(" s"), first
    assert first[-1].endswith("from earlier builds: 0 plan(s) from the build cache, 0 cubin(s) from the compile "
                              "cache"), first
    assert main(argv) == 0
    second = capsys.readouterr().out.splitlines()
    assert all(line.endswith(" (plan from the build cache, cubin from the compile cache)") for line in second[:-1])
    assert second[-1].endswith("3 plan(s) from the build cache, 3 cubin(s) from the compile cache"), second


def test_a_directory_compiles_every_file(capsys) -> None:
    assert main(["compile", str(EXAMPLES), "--arch", "sm_90"]) == 0
    out = capsys.readouterr().out
    for op in ("sin_axpb", "matmul", "softmax"):
        assert op in out


def test_run_check_and_profile_in_the_emulator(capsys) -> None:
    assert main(["run", str(EXAMPLES / "elementwise.py"), "--target", "sim", "--check", "--profile"]) == 0
    out = capsys.readouterr().out
    assert "sin_axpb [sim]" in out and "rel err" in out
    assert "y_kernel" in out and "GB/s" in out and "TFLOP/s" in out


def test_check_failure_exits_1(tmp_path: Path, capsys) -> None:
    f = _write(tmp_path, "wrong.py", GOOD.format(ref="x * 3.0"))
    assert main(["run", str(f), "--target", "sim", "--check"]) == 1
    assert "FAIL" in capsys.readouterr().out
    g = _write(tmp_path, "right.py", GOOD.format(ref="x * 2.0"))
    assert main(["run", str(g), "--target", "sim", "--check"]) == 0


def test_explain_shows_plan_and_launch(capsys) -> None:
    assert main(["explain", str(EXAMPLES / "matmul.py"), "--arch", "sm_90"]) == 0
    out = capsys.readouterr().out
    # the planner's ranking: a chosen point per kernel, the cost terms, and each kernel's launch shape
    assert "chosen:" in out and "predicted" in out and "runners-up" in out
    assert "C_kernel: grid" in out and "block (" in out


def test_tune_without_a_gpu_is_a_clear_error(capsys, monkeypatch) -> None:
    import tecc.cli

    monkeypatch.setattr(tecc.cli, "_gpu", lambda: False)
    monkeypatch.setattr("tecc.runtime.cuda.cuda_unavailable_reason", lambda: "no device (test)")
    for argv in (["tune", str(EXAMPLES / "matmul.py")], ["compile", "--tune", str(EXAMPLES / "matmul.py")]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("tecc: error: TeccError: tuning needs a CUDA device") and "Traceback" not in err
        assert 'plan="auto"' in err


def test_cache_info_and_clear_cover_the_compile_and_the_build_cache(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("TECC_BUILD_CACHE", "1")
    main(["compile", str(EXAMPLES / "matmul.py"), "--arch", "sm_90"])
    capsys.readouterr()
    assert main(["cache", "info"]) == 0
    out = capsys.readouterr().out
    assert f"compile cache   {tmp_path / 'cache' / 'cubin'}" in out and f"build cache     {tmp_path / 'cache' / 'builds'}" in out
    assert out.count("entries       1") == 2, out
    assert main(["cache", "clear"]) == 0
    out = capsys.readouterr().out
    assert "removed 1 compile-cache entry from" in out and "1 build-cache entry from" in out, out
    assert main(["cache", "info"]) == 0
    assert capsys.readouterr().out.count("entries       0") == 2
    assert main(["compile", str(EXAMPLES / "matmul.py"), "--arch", "sm_90"]) == 0
    assert "0 plan(s) from the build cache, 0 cubin(s)" in capsys.readouterr().out  # really gone


@pytest.mark.parametrize("text, expect", [
    (None, "no such file or directory"),
    ("x = 1\n", "declares no ops: define a module-level list OPS"),
    ("def f(:\n", "is not valid Python"),
    ("import numpy\n\nraise RuntimeError('boom')\n", "failed at line 3: RuntimeError: boom"),
    ("import tecc as tc\ntc.placeholder((2,), 'complex128', name='x')\n", "raised DTypeError"),
    (GOOD.format(ref="x") + "OPS = OPS + OPS\n", "several ops named double"),
])
def test_errors_are_one_paragraph_and_exit_2(tmp_path: Path, capsys, text: str | None, expect: str) -> None:
    path = tmp_path / "user_ops.py"
    if text is not None:
        path.write_text(text)
    assert main(["compile", str(path)]) == 2
    captured = capsys.readouterr()
    err = captured.err
    assert err.startswith("tecc: error: ")
    assert expect in " ".join(err.split()), err
    assert "Traceback" not in err
    assert "\n\n" not in err.strip()


def test_compile_errors_name_the_problem(tmp_path: Path, capsys) -> None:
    f = _write(tmp_path, "ok.py", GOOD.format(ref="x * 2.0"))
    assert main(["compile", str(f), "--arch", "sm_1"]) == 2
    err = capsys.readouterr().err
    assert "CompileError" in err and "sm_1" in err


def test_the_console_script_runs_and_exits_nonzero_on_error(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "tecc", "run", str(tmp_path / "missing.py")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "no such file or directory" in r.stderr and r.stdout == ""
    r = subprocess.run([sys.executable, "-m", "tecc"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "usage: tecc" in r.stderr


def test_traceback_flag_shows_the_traceback(tmp_path: Path, capsys) -> None:
    f = _write(tmp_path, "bad.py", "raise RuntimeError('boom')\n")
    assert main(["--traceback", "compile", str(f)]) == 2
    assert "Traceback" in capsys.readouterr().err


def test_progress_bar_appears_only_after_the_delay(monkeypatch: pytest.MonkeyPatch) -> None:
    import time

    from tecc.cli import _Progress

    monkeypatch.setenv("TECC_PROGRESS", "1")
    with _Progress(3, "quick") as bar:
        bar.advance()
    assert bar._started is False
    with _Progress(3, "slow", delay=0.05) as bar:
        bar.working_on("op")
        time.sleep(0.3)
        bar.advance()
    assert bar._started is True


def test_a_plan_chosen_elsewhere_is_replayed_by_compile_and_explain(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    import json

    import tecc as tc

    matmul = EXAMPLES / "matmul.py"
    assert main(["compile", str(matmul), "--arch", "sm_90", "-o", str(tmp_path / "a")]) == 0
    manifest = json.loads((tmp_path / "a" / "matmul.json").read_text())
    # another plan than the planner's: the naive one, as a plan file and as a mapping by op name
    naive = tc.default_plan().to_json()
    (tmp_path / "naive.json").write_text(naive)
    (tmp_path / "by_op.json").write_text(json.dumps({"matmul": json.loads(naive)}))
    capsys.readouterr()
    for plan_file in ("naive.json", "by_op.json"):
        out_dir = tmp_path / plan_file.replace(".json", "")
        assert main(["compile", str(matmul), "--arch", "sm_90", "-o", str(out_dir),
                     "--plan", str(tmp_path / plan_file)]) == 0
        replayed = json.loads((out_dir / "matmul.json").read_text())
        assert replayed["plan"]["strategy"] == "naive" != manifest["plan"]["strategy"]
    # an artifact's manifest replays the plan it was built with
    assert main(["explain", str(matmul), "--arch", "sm_90", "--plan", str(tmp_path / "a" / "matmul.json")]) == 0
    assert f"plan ({manifest['plan']['strategy']})" in capsys.readouterr().out


@pytest.mark.parametrize("content, says", [
    ("{not json", "not JSON"),
    ('{"steps": []}', "holds one plan, but the files declare"),
    ('{"nope": {"steps": []}}', "names ops the files do not declare: nope"),
    ("[1, 2]", "expected a plan"),
])
def test_a_bad_plan_file_is_a_usage_error_naming_it(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                    content: str, says: str) -> None:
    plan = _write(tmp_path, "plan.json", content)
    assert main(["explain", str(EXAMPLES), "--plan", str(plan)]) == 2
    err = " ".join(capsys.readouterr().err.split())  # the message is wrapped as one paragraph
    assert says in err and str(plan) in err


TWO_OPS = """
import numpy as np
import tecc as tc
n = tc.var("n")
x = tc.placeholder((n,), "float32", name="x")
y = tc.compute((n,), lambda i: x[i] * 2.0, name="y")
z = tc.compute((n,), lambda i: x[i] + 1.0, name="z")
OPS = [tc.OpSpec("wrong_values", [x, y], lambda x: x * 3.0, sizes={"n": 1000}),
       tc.OpSpec("wrong_shape", [x, z], lambda x: x[:10] + 1.0, sizes={"n": 1000}),
       tc.OpSpec("right", [x, y], lambda x: x * 2.0, sizes={"n": 1000})]
"""


@pytest.mark.parametrize("argv", [["check"], ["run", "--target", "sim", "--check"]])
def test_a_reference_of_the_wrong_shape_fails_its_op_in_one_line_and_the_others_are_still_checked(
        tmp_path: Path, capsys, argv: list[str]) -> None:
    f = _write(tmp_path, "refs.py", TWO_OPS)
    assert main([*argv, str(f)]) == 1  # a failed check, not an error of tecc
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    assert any("wrong_values [sim]" in line and "FAIL" in line for line in lines), captured.out
    shape = [line for line in lines if "wrong_shape [sim]" in line]
    assert len(shape) == 1 and shape[0].endswith(
        "FAIL: the reference returned shape (10,) for output z, whose shape is (1000,); fix the reference "
        "(or the op's sizes)"), captured.out
    assert any("right [sim] y: rel err" in line and "FAIL" not in line for line in lines), captured.out
    assert "internal error" not in captured.err and "bug in tecc" not in captured.err


@pytest.mark.parametrize("where, expect", [
    ("a_file", "it is a file, not a directory"),
    ("a_file/sub", "cannot create that directory (Not a directory)"),
    ("/proc/tecc_cannot_be_here", "cannot create that directory"),
])
def test_an_output_directory_that_cannot_be_written_is_a_one_line_error(tmp_path: Path, capsys, where: str,
                                                                        expect: str) -> None:
    (tmp_path / "a_file").write_text("not a directory\n")
    target = where if where.startswith("/") else str(tmp_path / where)
    assert main(["compile", str(EXAMPLES / "elementwise.py"), "-o", target]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"tecc: error: -o {target}: ") and expect in " ".join(err.split()), err
    assert "internal error" not in err and "Traceback" not in err and "\n\n" not in err.strip()
    assert (tmp_path / "a_file").read_text() == "not a directory\n"


def test_an_ops_file_imports_the_modules_next_to_it_as_under_python(tmp_path: Path, capsys,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "path", list(sys.path))  # restored after the test
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "tecc_test_helper_ops.py").write_text(
        "import tecc as tc\n\n"
        "def doubled(n):\n"
        "    x = tc.placeholder((n,), 'float32', name='x')\n"
        "    return x, tc.compute((n,), lambda i: x[i] * 2.0, name='y')\n\n"
        "def reference(x):\n"
        "    return 2.0 * x\n")
    ops = _write(folder, "myops.py", "import tecc as tc\nfrom tecc_test_helper_ops import doubled, reference\n"
                                     "OPS = [tc.OpSpec('double', list(doubled(300)), reference)]\n")
    monkeypatch.chdir(tmp_path)  # not the file's folder
    monkeypatch.delitem(sys.modules, "tecc_test_helper_ops", raising=False)
    try:
        assert main(["check", str(ops)]) == 0, capsys.readouterr().err
    finally:
        sys.modules.pop("tecc_test_helper_ops", None)
    out = capsys.readouterr().out
    assert "double [" in out and "y: rel err" in out and "FAIL" not in out, out


def test_another_ops_plan_is_an_error_that_says_whose_plan_it_is_and_what_it_names(tmp_path: Path, capsys) -> None:
    assert main(["compile", str(EXAMPLES / "matmul.py"), "--arch", "sm_90", "-o", str(tmp_path / "out")]) == 0
    capsys.readouterr()
    manifest = tmp_path / "out" / "matmul.json"
    assert main(["compile", str(EXAMPLES / "elementwise.py"), "--plan", str(manifest)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert err.startswith(f"tecc: error: --plan {manifest} (the plan of op matmul, from its artifact) does not "
                          "schedule op sin_axpb: the plan is for another program: it names kernel(s) C_kernel, "
                          "and this program's kernels are y_kernel"), err
    assert "internal error" not in err


def test_explain_of_several_ops_names_each_op_above_its_report(capsys) -> None:
    assert main(["explain", str(EXAMPLES / "norms.py"), "--arch", "sm_90"]) == 0
    out = capsys.readouterr().out
    headers = [line for line in out.splitlines() if line.startswith("== op ")]
    path = EXAMPLES / "norms.py"
    assert headers == [f"== op {name} ({path}) ==" for name in ("layer_norm", "rms_norm", "log_softmax")], out
    blocks = out.split("== op ")[1:]
    assert all("grid (" in block for block in blocks), out  # each header is followed by its own report
