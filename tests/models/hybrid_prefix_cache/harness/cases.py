# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Cases: how one runs, as a growing conversation (:func:`run_case`) or a
resend (:func:`run_resend`), each in a session on its servers
(``CaseSession.serve``) judged by its known failures (harness/session.py)."""

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import pytest

from tests.models.hybrid_prefix_cache.harness.client import send_checked
from tests.models.hybrid_prefix_cache.harness.compare import Found, Turn
from tests.models.hybrid_prefix_cache.harness.conversation import (
    Conversation,
    Play,
    finish_turns,
    fresh_salt,
    planned_turn,
    play_turn,
    play_waves,
    random_tokens,
    reference_conversation,
    shape_length,
)
from tests.models.hybrid_prefix_cache.harness.deployment import (
    Binding,
    Deployment,
    Known,
    Mode,
    Units,
    with_serve_env,
)
from tests.models.hybrid_prefix_cache.harness.known import evidence_shown
from tests.models.hybrid_prefix_cache.harness.records import CaseRecord
from tests.models.hybrid_prefix_cache.harness.rules import NUM_TURNS, PlannedTurn
from tests.models.hybrid_prefix_cache.harness.servers import ServerPool
from tests.models.hybrid_prefix_cache.harness.session import case_session


@dataclass
class Suite:
    """What a session's cases share (owned by the ``hybrid_suite`` fixture or a
    benchmark): the pool of reused servers and every case's record."""

    pool: ServerPool = field(default_factory=ServerPool)
    records: list[CaseRecord] = field(default_factory=list)

    def __repr__(self) -> str:
        return (
            f"Suite({len(self.records)} case records, {self.pool.starts} server starts)"
        )

    def close(self) -> None:
        self.pool.close()


def run_case(
    suite: Suite,
    case_id: str,
    binding: Binding,
    deployment: Deployment,
    mode: Mode,
    *,
    shapes: Sequence[str] = (),
    concurrent: bool = False,
    restores: bool = False,
    known: Sequence[Known] = (),
    num_turns: int = NUM_TURNS,
    resend: bool = True,
) -> CaseRecord:
    """Check the reference conversation, or one per sweep shape the servers have,
    at once under ``batch_invariant_env`` (``concurrent``) or at the servers' own
    threads held on the hits' prefill steps (``restores``). A case in ``known``
    xfails, skips or fails here (harness/session.py)."""
    __tracebackhide__ = True
    if concurrent and binding.batch_invariant_env is not None:
        deployment = with_serve_env(deployment, binding.batch_invariant_env)
    batched = concurrent or restores
    with (
        case_session(case_id, suite.records, known) as case,
        case.serve(binding, deployment, mode, suite.pool, batched, restores) as play,
    ):
        units = play.units
        conversations = [
            Conversation(shape, length, f"{case_id}-{shape}", num_turns, resend)
            for shape in dict.fromkeys(shapes)
            if (length := shape_length(shape, units)) is not None
        ]
        if not shapes:
            reference = reference_conversation(units, case_id)
            conversations = [replace(reference, num_turns=num_turns, resend=resend)]
        elif not conversations:
            pytest.skip(
                f"shapes {list(shapes)} need a hit unit below the block; this "
                f"server has hit unit {units.hit}, block {units.block}"
            )
        for _ in play_waves(play, conversations, case.turns):
            # A known bug's evidence confirms the case: later turns change
            # nothing (an XPASS still plays them all).
            if evidence_shown(case.entry, [p for t in case.turns for p in t.problems]):
                case.add(
                    notice=f"stopped after {case.turns[-1].name}: the known "
                    f"failure's evidence showed ({case.entry.expects})"
                )
                break
        finish_turns(play, case.turns)
    assert case.record is not None
    return case.record


def run_resend(
    suite: Suite,
    case_id: str,
    binding: Binding,
    deployment: Deployment,
    mode: Mode,
    prompt_len: int | Callable[[Units], int],
    failure: Callable[[str], str] | None = None,
    resend_problems: Callable[[Turn, Play], list[str]] | None = None,
    known: Sequence[Known] = (),
) -> CaseRecord:
    """Send one prompt cold, resend it, and recompute it under a fresh salt: the
    resend hits at least the prompt's own checkpoint (:func:`expected_resend`).
    ``prompt_len`` may be a
    function of the servers' units, and ``failure`` names a property."""
    __tracebackhide__ = True
    with (
        case_session(case_id, suite.records, known) as case,
        case.serve(binding, deployment, mode, suite.pool) as play,
    ):
        if callable(prompt_len):
            prompt_len = prompt_len(play.units)
        prompt = random_tokens(random.Random(case_id), binding.token_ids, prompt_len)
        salt = fresh_salt("resend")
        cold = Turn("", 0, prompt_len, 0, 0, prompt=prompt, salt=salt)
        case.add(cold)
        cold.output, found = send_checked(play.servers, binding.model, prompt, salt)
        cold.take(Found(tuple(found)))
        if cold.output.cached_tokens != 0:
            hit = f"cold request: cached {cold.output.cached_tokens}, expected 0"
            cold.take(Found((hit,)))
        resend = planned_turn(play, "", PlannedTurn(1, prompt_len, prompt_len, True))
        case.add(resend)
        play_turn(play, resend, prompt, salt)
        finish_turns(play, case.turns)
        if resend_problems is not None:
            resend.take(Found(tuple(resend_problems(resend, play))))
        if failure is not None and any(turn.problems for turn in case.turns):
            case.add(problem=failure(f"a {prompt_len}-token prompt"))
    assert case.record is not None
    return case.record
