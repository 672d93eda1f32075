# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Turns replayed from measured records and checked by the oracle
(harness.compare.check_turn), and cases whose engine crashed as a failure's report
says, for the tests of the oracle's comparisons and known failures. No server."""

from pathlib import Path
from types import SimpleNamespace

import requests

from tests.models.hybrid_prefix_cache.harness import Deployment, Known, Units, rules
from tests.models.hybrid_prefix_cache.harness.compare import Sample, Turn, check_turn
from tests.models.hybrid_prefix_cache.harness.servers import ServerError
from tests.models.hybrid_prefix_cache.harness.session import case_session
from tests.models.hybrid_prefix_cache.workloads import small_budget

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
    """A greedy sample of ``tokens`` (from index ``shift`` on) whose logprobs sit
    ``gap`` away from BASE from index ``at`` on, each with a runner-up 0.5 below."""
    tokens = tokens[shift:]
    logprobs = [lp + (gap if i >= at else 0.0) for i, lp in enumerate(BASE[shift:])]
    top = [{token: lp, RUNNER_UP: lp - 0.5} for token, lp in zip(tokens, logprobs)]
    return Sample(
        list(tokens), "", logprobs, top, prompt_tokens=prompt_len, cached_tokens=cached
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
    backoff = fields.pop("backoff", 0)
    seen_prev = max(prev_len - backoff, 0)
    return Turn(
        fields.pop("conversation", ""),
        index,
        prompt_len,
        prev_len,
        rules.expected_cached(seen_prev, unit, fields.pop("drops_unit", False)),
        bound=rules.hit_bound(seen_prev, prompt_len - backoff, unit),
        resend=fields.pop("resend", False),
        backoff=backoff,
        output=hit,
        recompute=recompute,
        **fields,
    )


def _checked(units: Units, hit: Sample, index: int, prev_len: int, **fields) -> Turn:
    """A turn that played ``hit`` against a recompute at BASE, checked by the oracle."""
    length = hit.prompt_tokens
    played = turn(
        index, prev_len, length, units.hit, hit, sample(prompt_len=length), **fields
    )
    played.take(check_turn(played, units, 0.0))
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
    """A turn of sweep ``shape`` that hit ``hit`` where the previous ``prev_len``-token
    prompt left a deeper checkpoint, at block ``block`` (the hit unit by default)."""
    output = sample(cached=hit, prompt_len=prev_len + rules.TURN_TOKENS)
    units = Units(block=block or unit, hit=unit)
    return _checked(
        units, output, index, prev_len, conversation=shape, drops_unit=drops_unit
    )


def lost_resend_turn(
    prompt_len: int, unit: int, backoff: int = 0, hit: int = 0, drops_unit: bool = False
) -> Turn:
    """An exact resend that hit ``hit`` where its checkpoint is (of the prompt less
    ``backoff``, which the P/D prefiller sees; a unit lower where ``drops_unit``)."""
    output = sample(cached=hit, prompt_len=prompt_len)
    fields = {"resend": True, "backoff": backoff, "drops_unit": drops_unit}
    return _checked(Units(block=unit, hit=unit), output, 1, prompt_len, **fields)


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
    """A turn of sweep ``shape`` that hit its checkpoint, logprobs ``gap`` from its
    recompute, or under P/D (``pd``: the prefiller sees a token less) its cold twin."""
    backoff = 1 if pd else 0
    cached = rules.expected_cached(max(prev_len - backoff, 0), unit, False)
    twin = {"twin": sample(prompt_len=prompt_len)} if pd else {}
    output = sample(gap, cached=cached, prompt_len=prompt_len)
    units = Units(block=block or unit, hit=unit)
    return _checked(
        units, output, index, prev_len, backoff=backoff, conversation=shape, **twin
    )


def branch_apart_turn(
    units: Units, gap: float, pd: bool = False, parts_at: int | None = None
) -> Turn:
    """A small-budget branch resumed at its block checkpoint, logprobs ``gap`` from its
    recompute (``pd``: its cold twin), or taking the runner-up at ``parts_at``."""
    shared, length = small_budget.branch_lengths(units)
    cached = small_budget.branch_checkpoint(shared, units, False)
    hit = sample(gap, cached=cached, prompt_len=length)
    if parts_at is not None:
        hit.token_ids[parts_at] = RUNNER_UP
        lp = hit.token_logprobs[parts_at]
        hit.top_logprobs[parts_at] = {RUNNER_UP: lp, TOKENS[parts_at]: lp - gap}
    twin = {"twin": sample(prompt_len=length), "backoff": 1} if pd else {}
    recompute = sample(prompt_len=length)
    played = turn(
        0, shared, length, units.hit, hit, recompute, conversation="branch", **twin
    )
    played.expected = cached
    played.take(check_turn(played, units, 0.0))
    return played


def crashed_case(
    case_id: str, entry: Known, text: str, folder: Path, how: str, units: Units
) -> None:
    """Run ``entry`` over a case whose engine crashed with ``text`` in its log: the
    request that met it raises ServerError with that log (``how="request"``), or a later
    metrics read fails while only the log holds the cause (``how="metrics"``)."""
    log = folder / f"{how}.log"
    log.write_text(f"INFO starting\n{text}\nERROR EngineCore died\n")
    with case_session(case_id, known=(entry,)) as case:
        case.units = units
        # What a session reads of a play: its server's log (failure_text), and
        # what the record's ``serve`` names.
        case.play = SimpleNamespace(
            servers=[SimpleNamespace(log_path=log)],
            noise=None,
            binding=SimpleNamespace(model="m"),
            deployment=Deployment(),
            recompute_atol=None,
        )
        if how == "request":
            raise ServerError("serve answered a completion with 500", log.read_text())
        raise requests.ConnectionError("metrics: connection refused")
