"""The cost model's ranking of candidates the H200 timed (benchmarks/results/planner_regret_h200_s25.json),
replayed by benchmarks/regret_replay.py: the pick among the measured candidates of a few problems
stays within 5% of the best measured one (the float32 convolutions whose k-tile 8 and many-part
split-K points the model used to rank first), and problems the model already picked right keep
their pick (16-bit GEMMs and convolutions on tensor cores, attention, large float32 GEMMs)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import regret_replay  # noqa: E402  (benchmarks/regret_replay.py)

ROWS = {(r["grid"], r["problem"]): r for r in json.loads(regret_replay.DEFAULT_JSON.read_text())["rows"]}


def _replay(grid: str, problem: str) -> Any:
    r = regret_replay.replay_row(ROWS[(grid, problem)], regret_replay.h200())
    assert r is not None and r.missing == 0, "every measured candidate is still proposed"
    return r


@pytest.mark.parametrize("problem, old", [
    ("float32 32x56x56x64x256x1x1", 0.49),     # 128x128 k-tile 8 (140 us) picked, 128x64 k-tile 16 94 us
    ("float32 32x7x7x512x512x3x1", 0.35),      # split-K 16 at k-tile 8 picked, split 4 at k-tile 16 best
    ("float32 32x28x28x128x128x3x1", 0.25),    # 128x128 split-K 4 k-tile 8 picked, 64x128 k-tile 16 best
    ("float32 32x56x56x128x128x3x2", 0.11),
])
def test_float32_conv_picks_among_the_measured_are_within_5_percent(problem: str, old: float) -> None:
    r = _replay("conv", problem)
    assert r.old_regret == pytest.approx(old, abs=0.01)    # the run's pick, for the record
    assert r.new_regret <= 0.055, r.order
    assert "k-tile 16" in r.new_pick, r.order


@pytest.mark.parametrize("grid, problem", [
    ("gemm", "float16 1x4096x4096x4096"), ("gemm", "bfloat16 1x1000x1000x1000"),
    ("gemm", "float32 1x2048x2048x2048"), ("gemm", "float32 1x4096x1024x4096"),
    ("conv", "float16 32x28x28x512x128x1x1"), ("conv", "float32 32x56x56x256x64x1x1"),
    ("attention", "S=4096 d=64 causal"), ("attention", "S=8192 d=128"),
])
def test_picks_the_model_had_right_are_kept(grid: str, problem: str) -> None:
    r = _replay(grid, problem)
    assert r.new_regret == pytest.approx(r.old_regret, abs=1e-9)
    assert r.new_regret <= 0.055


def test_the_replay_table_counts_each_problem_once_per_grid() -> None:
    rows = [_replay("conv", "float32 32x56x56x64x256x1x1"), _replay("gemm", "float16 1x4096x4096x4096")]
    text = regret_replay.table(rows)
    assert "| conv | 1 |" in text and "| conv fp32 | 1 |" in text and "| gemm 16-bit | 1 |" in text
    assert "| attention |" not in text
