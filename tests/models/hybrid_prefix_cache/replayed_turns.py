# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Turns replayed from measured records and checked by the oracle
(harness.compare.check_turn), and cases whose engine crashed as a failure's
report says (:func:`crashed_case`), for the tests of the oracle's comparisons
and of the known failures' evidence. No server."""

from pathlib import Path
from types import SimpleNamespace

import requests

from tests.models.hybrid_prefix_cache.harness import (
    Deployment,
    Known,
    Units,
)
from tests.models.hybrid_prefix_cache.harness.compare import (
    Sample,
    Turn,
    check_turn,
)
from tests.models.hybrid_prefix_cache.harness.rules import (
    TURN_TOKENS,
    expected_cached,
    hit_bound,
)
from tests.models.hybrid_prefix_cache.harness.servers import ServerError
from tests.models.hybrid_prefix_cache.harness.session import case_session
from tests.models.hybrid_prefix_cache.workloads.small_budget import (
    branch_checkpoint,
    branch_lengths,
)

TOKENS = [11, 12, 13, 14, 15, 16, 17, 18]
BASE = [-0.5, -0.25, -1.0, -0.75, -0.5, -2.0, -0.125, -1.5]
RUNNER_UP = 99  # every position's second choice, 0.5 below the first


def sample(
    gap: float = 0.0,
    cached: int = 0,
    prompt_len: int = 805,
    tokens: list[int] = TOKENS,
    at: int = 0,
    shift: int = 0,
) -> Sample:
    """A greedy sample of ``tokens`` (from index ``shift`` on) whose
    logprobs sit ``gap`` away from BASE from index ``at`` on, each position
    with a runner-up 0.5 below in its top-k."""
    tokens = tokens[shift:]
    logprobs = [lp + (gap if i >= at else 0.0) for i, lp in enumerate(BASE[shift:])]
    return Sample(
        token_ids=list(tokens),
        text="",
        token_logprobs=logprobs,
        top_logprobs=[
            {token: lp, RUNNER_UP: lp - 0.5} for token, lp in zip(tokens, logprobs)
        ],
        prompt_tokens=prompt_len,
        cached_tokens=cached,
    )


def turn(
    index: int,
    prev_len: int,
    prompt_len: int,
    unit: int,
    hit: Sample,
    recompute: Sample,
    **fields,
) -> Turn:
    resend = fields.pop("resend", False)
    drops = fields.pop("drops_unit", False)
    backoff = fields.pop("backoff", 0)
    seen_prev, seen = max(prev_len - backoff, 0), prompt_len - backoff
    played = Turn(
        fields.pop("conversation", ""),
        index,
        prompt_len,
        prev_len,
        expected_cached(seen_prev, unit, drops),
        bound=hit_bound(seen_prev, seen, unit),
        resend=resend,
        backoff=backoff,
        output=hit,
        recompute=recompute,
        **fields,
    )
    return played


def lost_checkpoint_turn(
    shape: str,
    index: int,
    prev_len: int,
    unit: int,
    hit: int = 0,
    block: int | None = None,
    drops_unit: bool = False,
) -> Turn:
    """A turn of sweep ``shape`` that hit ``hit`` (nothing by default) where
    the previous ``prev_len``-token prompt left a deeper checkpoint, checked
    by the oracle at block ``block`` (the hit unit by default)."""
    prompt_len = prev_len + TURN_TOKENS
    played = turn(
        index,
        prev_len,
        prompt_len,
        unit,
        sample(cached=hit, prompt_len=prompt_len),
        sample(prompt_len=prompt_len),
        conversation=shape,
        drops_unit=drops_unit,
    )
    played.take(check_turn(played, Units(block=block or unit, hit=unit), 0.0))
    return played


def lost_resend_turn(
    prompt_len: int,
    unit: int,
    backoff: int = 0,
    hit: int = 0,
    drops_unit: bool = False,
) -> Turn:
    """An exact resend of ``prompt_len`` tokens that hit ``hit`` (nothing by
    default) where its own checkpoint is (of the prompt less ``backoff``,
    which the P/D prefiller sees; one unit lower where the drafter
    ``drops_unit``), checked by the oracle."""
    played = turn(
        1,
        prompt_len,
        prompt_len,
        unit,
        sample(cached=hit, prompt_len=prompt_len),
        sample(prompt_len=prompt_len),
        resend=True,
        backoff=backoff,
        drops_unit=drops_unit,
    )
    played.take(check_turn(played, Units(block=unit, hit=unit), 0.0))
    return played


def restored_apart_turn(
    shape: str,
    index: int,
    prev_len: int,
    prompt_len: int,
    unit: int,
    gap: float,
    block: int | None = None,
    pd: bool = False,
) -> Turn:
    """A turn of sweep ``shape`` that hit its checkpoint and whose logprobs
    sit ``gap`` from the request on its own path: its recompute (played
    alone), or under P/D (``pd``: the prefiller sees the prompt one token
    short) its cold twin through the same pair; checked by the oracle."""
    backoff = 1 if pd else 0
    cached = expected_cached(max(prev_len - backoff, 0), unit, False)
    twin = {"twin": sample(prompt_len=prompt_len)} if pd else {}
    played = turn(
        index,
        prev_len,
        prompt_len,
        unit,
        sample(gap, cached=cached, prompt_len=prompt_len),
        sample(prompt_len=prompt_len),
        backoff=backoff,
        conversation=shape,
        **twin,
    )
    played.take(check_turn(played, Units(block=block or unit, hit=unit), 0.0))
    return played


def branch_apart_turn(
    units: Units, gap: float, pd: bool = False, parts_at: int | None = None
) -> Turn:
    """A small-budget case's branch that resumed at its block checkpoint
    (small_budget.branch_checkpoint) and whose logprobs sit ``gap`` from its
    recompute on the same server, or under P/D (``pd``) from its cold twin
    through the same pair, or (``parts_at``) that takes the runner-up there;
    checked by the oracle."""
    shared, length = branch_lengths(units)
    cached = branch_checkpoint(shared, units, False)
    hit = sample(gap, cached=cached, prompt_len=length)
    if parts_at is not None:
        hit.token_ids[parts_at] = RUNNER_UP
        lp = hit.token_logprobs[parts_at]
        hit.top_logprobs[parts_at] = {RUNNER_UP: lp, TOKENS[parts_at]: lp - gap}
    twin = {"twin": sample(prompt_len=length), "backoff": 1} if pd else {}
    played = turn(
        0,
        shared,
        length,
        units.hit,
        hit,
        sample(prompt_len=length),
        conversation="branch",
        **twin,
    )
    played.expected = cached
    played.take(check_turn(played, units, 0.0))
    return played


def _stand_in_play(log: Path) -> SimpleNamespace:
    """What a session reads of a case's play: the log file of its server
    (failure_text), and what its record's ``serve`` names."""
    return SimpleNamespace(
        servers=[SimpleNamespace(log_path=log)],
        noise=None,
        binding=SimpleNamespace(model="m"),
        deployment=Deployment(),
        recompute_atol=None,
    )


def crashed_case(
    case_id: str, entry: Known, text: str, folder: Path, how: str, units: Units
) -> None:
    """Run ``entry`` over a case whose engine crashed with ``text`` in its
    log (in ``folder``): the request that met the crash raises ServerError
    with that log (``how="request"``), or a later metrics read fails while
    only the log file on disk holds the cause (``how="metrics"``)."""
    log = folder / f"{how}.log"
    log.write_text(f"INFO starting\n{text}\nERROR EngineCore died\n")
    with case_session(case_id, known=(entry,)) as case:
        case.units, case.play = units, _stand_in_play(log)
        if how == "request":
            raise ServerError("serve answered a completion with 500", log.read_text())
        raise requests.ConnectionError("metrics: connection refused")
