# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What a check found: a :class:`Problem` is the sentence people read, with the kind,
turn and numbers a known failure's :class:`Finding` matches (not its wording)."""

from collections.abc import Mapping
from dataclasses import dataclass

# The kinds a known failure can name, each with the numbers its check gives.
KINDS = {
    # The hit is below the previous prompt's last checkpoint.
    "lost-checkpoint": ("cached", "expected", "previous"),
    # A resend does not hit its own prompt's checkpoint.
    "resend-missed": ("cached", "expected", "seen"),
    # A hit that restored state differs from its control on its own path.
    "hit-apart": ("restored", "control"),
    # vLLM's scheduler, replayed in-process, hits otherwise than expected.
    "scheduler-hit": ("hit", "expected"),
}


class Problem(str):
    """A str: read, joined and written as its sentence; kindless ones match none."""

    kind: str
    where: str
    numbers: Mapping[str, object]

    def __new__(
        cls, text: str, kind: str = "", where: str = "", **numbers: object
    ) -> "Problem":
        if kind and (kind not in KINDS or set(numbers) != set(KINDS[kind])):
            raise ValueError(f"{kind}'s numbers are {KINDS.get(kind)}, not {numbers}")
        problem = super().__new__(cls, text)
        problem.kind, problem.where, problem.numbers = kind, where, dict(numbers)
        return problem

    def as_json(self) -> dict:
        return {"kind": self.kind, "where": self.where, "numbers": dict(self.numbers)}


@dataclass(frozen=True)
class Finding:
    """What a known failure's record shows: a problem of ``kind`` about the turn
    ``where``, with at least ``numbers`` (name, value) among its numbers."""

    kind: str
    where: str
    numbers: tuple[tuple[str, object], ...]

    def __post_init__(self) -> None:
        unknown = {name for name, _ in self.numbers} - set(KINDS.get(self.kind, ()))
        if self.kind not in KINDS or unknown:
            raise ValueError(f"no check finds {self.kind} with {sorted(unknown)}")

    def shown_by(self, problem: str) -> bool:
        if not isinstance(problem, Problem):
            return False
        same = (problem.kind, problem.where) == (self.kind, self.where)
        return same and all(problem.numbers.get(k) == v for k, v in self.numbers)

    def __str__(self) -> str:
        numbers = ", ".join(f"{name} {value}" for name, value in self.numbers)
        return f"{self.kind} at {self.where} ({numbers})"


def finding(kind: str, where: str, **numbers: object) -> Finding:
    return Finding(kind, where, tuple(numbers.items()))
