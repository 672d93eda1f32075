# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Cases: a growing conversation (:func:`run_case`) or a resend (:func:`run_resend`),
each in a session on its servers judged by its known failures (harness/session.py)."""

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import pytest

from tests.models.hybrid_prefix_cache.harness import conversation, rules, session
from tests.models.hybrid_prefix_cache.harness.client import send_checked
from tests.models.hybrid_prefix_cache.harness.compare import Found, Turn
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
from tests.models.hybrid_prefix_cache.harness.servers import ServerPool


@dataclass
class Suite:
    """What a session's cases share (owned by the ``hybrid_suite`` fixture or a
    benchmark): the pool of reused servers and every case's record."""

    pool: ServerPool = field(default_factory=ServerPool)
    records: list[CaseRecord] = field(default_factory=list)

    def __repr__(self) -> str:
        records, starts = len(self.records), self.pool.starts
        return f"Suite({records} case records, {starts} server starts)"

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
    num_turns: int = rules.NUM_TURNS,
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
        session.case_session(case_id, suite.records, known) as case,
        case.serve(binding, deployment, mode, suite.pool, batched, restores) as play,
    ):
        units = play.units
        conversations = [
            conversation.Conversation(s, length, f"{case_id}-{s}", num_turns, resend)
            for s in dict.fromkeys(shapes)
            if (length := conversation.shape_length(s, units)) is not None
        ]
        if not shapes:
            reference = conversation.reference_conversation(units, case_id)
            conversations = [replace(reference, num_turns=num_turns, resend=resend)]
        elif not conversations:
            pytest.skip(
                f"shapes {list(shapes)} need a hit unit below the block; this "
                f"server has hit unit {units.hit}, block {units.block}"
            )
        for _ in conversation.play_waves(play, conversations, case.turns):
            # The known bug's evidence confirms the case (an XPASS plays every turn).
            if evidence_shown(case.entry, [p for t in case.turns for p in t.problems]):
                case.add(
                    notice=f"stopped after {case.turns[-1].name}: the known "
                    f"failure's evidence showed ({case.entry.expects})"
                )
                break
        conversation.finish_turns(play, case.turns)
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
    resend_problems: Callable[[Turn, conversation.Play], list[str]] | None = None,
    known: Sequence[Known] = (),
) -> CaseRecord:
    """Send one prompt cold, resend it, recompute it under a fresh salt: the resend
    hits at least its own checkpoint (:func:`expected_resend`). ``prompt_len`` may
    depend on the servers' units; ``failure`` names a property."""
    __tracebackhide__ = True
    with (
        session.case_session(case_id, suite.records, known) as case,
        case.serve(binding, deployment, mode, suite.pool) as play,
    ):
        if callable(prompt_len):
            prompt_len = prompt_len(play.units)
        prompt = conversation.random_tokens(
            random.Random(case_id), binding.token_ids, prompt_len
        )
        salt = conversation.fresh_salt("resend")
        cold = Turn("", 0, prompt_len, 0, 0, prompt=prompt, salt=salt)
        case.add(cold)
        cold.output, found = send_checked(play.servers, binding.model, prompt, salt)
        cold.take(Found(tuple(found)))
        if cold.output.cached_tokens != 0:
            hit = f"cold request: cached {cold.output.cached_tokens}, expected 0"
            cold.take(Found((hit,)))
        resend = conversation.planned_turn(
            play, "", rules.PlannedTurn(1, prompt_len, prompt_len, True)
        )
        case.add(resend)
        conversation.play_turn(play, resend, prompt, salt)
        conversation.finish_turns(play, case.turns)
        if resend_problems is not None:
            resend.take(Found(tuple(resend_problems(resend, play))))
        if failure is not None and any(turn.problems for turn in case.turns):
            case.add(problem=failure(f"a {prompt_len}-token prompt"))
    assert case.record is not None
    return case.record
