# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Turns replayed from measured records, checked by the oracle (compare.check_turn), and
crashes as reports show them, for the oracle's and known failures' tests. No server."""

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
    index: int, prev: int, length: int, unit: int, hit: Sample, rec: Sample, **fields
) -> Turn:
    """A ``length``-token turn after a ``prev``-token prompt; ``fields``: the Turn's,
    and ``drops_unit`` (the drafter's rule); ``expected`` by the rules unless given."""
    backoff = fields.get("backoff", 0)
    seen_prev = max(prev - backoff, 0)
    expected = rules.expected_cached(seen_prev, unit, fields.pop("drops_unit", False))
    return Turn(
        fields.pop("conversation", ""),
        index,
        length,
        prev,
        fields.pop("expected", expected),
        bound=rules.hit_bound(seen_prev, length - backoff, unit),
        output=hit,
        recompute=rec,
        **fields,
    )


def _checked(units: Units, hit: Sample, index: int, prev_len: int, **fields) -> Turn:
    """A turn that played ``hit`` against a recompute at BASE, checked by the oracle."""
    rec = sample(prompt_len=hit.prompt_tokens)
    played = turn(index, prev_len, hit.prompt_tokens, units.hit, hit, rec, **fields)
    played.take(check_turn(played, units, 0.0))
    return played


def lost_checkpoint_turn(
    shape: str, index: int, prev_len: int, units: Units, hit: int = 0, **fields
) -> Turn:
    """A turn of sweep ``shape`` that hit ``hit`` where the previous ``prev_len``-token
    prompt left a deeper checkpoint (``fields``: the Turn's, or ``drops_unit``)."""
    output = sample(cached=hit, prompt_len=prev_len + rules.TURN_TOKENS)
    return _checked(units, output, index, prev_len, conversation=shape, **fields)


def lost_resend_turn(prompt_len: int, unit: int, hit: int = 0, **fields) -> Turn:
    """An exact resend that hit ``hit`` where its checkpoint is (of the prompt less a
    ``backoff``, which the P/D prefiller sees; a unit lower where ``drops_unit``)."""
    output = sample(cached=hit, prompt_len=prompt_len)
    units = Units(block=unit, hit=unit)
    return _checked(units, output, 1, prompt_len, resend=True, **fields)


def restored_apart_turn(
    shape: str, index: int, prev_len: int, units: Units, gap: float, pd: bool = False
) -> Turn:
    """A turn of sweep ``shape`` that hit its checkpoint, logprobs ``gap`` from its
    recompute, or under P/D (``pd``: the prefiller sees a token less) its cold twin."""
    backoff = 1 if pd else 0
    cached = rules.expected_cached(max(prev_len - backoff, 0), units.hit, False)
    length = prev_len + rules.TURN_TOKENS
    twin = {"twin": sample(prompt_len=length)} if pd else {}
    output = sample(gap, cached=cached, prompt_len=length)
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
    return _checked(
        units, hit, 0, shared, conversation="branch", expected=cached, **twin
    )


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
        # What a session reads: its server's log (failure_text), the record's ``serve``.
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
