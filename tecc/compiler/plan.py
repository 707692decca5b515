"""The Plan: the list of schedule steps with their parameters, as JSON.

It is what the planner produces, what the cost model scores, what the tuner measures, what the
tuning database stores and what a user may pass in by hand. Replaying a plan is deterministic.
`strategy` names where it came from (e.g. "naive" for the default schedule), `reason` says why it
was chosen."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Step:
    """One primitive application: its name and JSON-serializable arguments."""

    primitive: str
    args: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"primitive": self.primitive, "args": self.args}

    @staticmethod
    def from_json(j: dict[str, Any]) -> "Step":
        return Step(j["primitive"], dict(j.get("args", {})))


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
        j = json.loads(text) if isinstance(text, str) else text
        return Plan(tuple(Step.from_json(s) for s in j.get("steps", [])), j.get("strategy", "manual"),
                    j.get("reason", ""))

    def __str__(self) -> str:
        lines = [f"plan ({self.strategy}){': ' + self.reason if self.reason else ''}"]
        for s in self.steps:
            args = ", ".join(f"{k}={v!r}" for k, v in s.args.items())
            lines.append(f"  {s.primitive}({args})")
        return "\n".join(lines)
