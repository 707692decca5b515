"""The Plan: the list of schedule steps with their parameters, as JSON.

It is what the planner produces, what the cost model scores, what the tuner measures, what the
tuning database stores and what a user may pass in by hand. Replaying a plan is deterministic.
`strategy` names where it came from (e.g. "naive" for the default schedule), `reason` says why it
was chosen."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from ..ir.errors import ScheduleError


@dataclass(frozen=True)
class Step:
    """One primitive application: its name and JSON-serializable arguments."""

    primitive: str
    args: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"primitive": self.primitive, "args": self.args}

    @staticmethod
    def from_json(j: dict[str, Any], where: str = "plan step") -> "Step":
        if not isinstance(j, dict) or not isinstance(j.get("primitive"), str):
            raise ScheduleError(f"{where} is {json.dumps(j)[:80]}; a step is an object "
                                '{"primitive": NAME, "args": {...}} (see docs/schedule.md)')
        args = j.get("args", {})
        if not isinstance(args, dict):
            raise ScheduleError(f"{where} ({j['primitive']}): args must be an object of keyword arguments, "
                                f"got {json.dumps(args)[:80]}")
        return Step(j["primitive"], dict(args))


@dataclass(frozen=True)
class Plan:
    steps: tuple[Step, ...] = ()
    strategy: str = "manual"
    reason: str = ""

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    def to_dict(self) -> dict[str, Any]:
        return {"strategy": self.strategy, "reason": self.reason, "steps": [s.to_json() for s in self.steps]}

    @staticmethod
    def from_json(text: str | dict[str, Any]) -> "Plan":
        if isinstance(text, str):
            try:
                j = json.loads(text)
            except json.JSONDecodeError as exc:
                raise ScheduleError(f"the plan is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}; "
                                    "pass plan='auto', a Plan, or the JSON of one (Plan.to_json())") from exc
        else:
            j = text
        if not isinstance(j, dict):
            raise ScheduleError(f"a plan is a JSON object with a list 'steps', got {type(j).__name__}; "
                                "pass plan='auto', a Plan, or the JSON of one (Plan.to_json())")
        steps = j.get("steps", [])
        if not isinstance(steps, list):
            raise ScheduleError(f"the plan's 'steps' must be a list of steps, got {json.dumps(steps)[:80]}")
        return Plan(tuple(Step.from_json(s, f"plan step {n}") for n, s in enumerate(steps)),
                    str(j.get("strategy", "manual")), str(j.get("reason", "")))

    def __str__(self) -> str:
        lines = [f"plan ({self.strategy}){': ' + self.reason if self.reason else ''}"]
        for s in self.steps:
            args = ", ".join(f"{k}={v!r}" for k, v in s.args.items())
            lines.append(f"  {s.primitive}({args})")
        return "\n".join(lines)
