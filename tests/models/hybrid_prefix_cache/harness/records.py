# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A case's record (:class:`CaseRecord`): what it saw and its verdict, for ``assert
record.ok, record.explain()``, and its JSON (:func:`report`), for the reproducer."""

import json
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from tests.models.hybrid_prefix_cache.harness import client, compare, deployment, paths
from tests.models.hybrid_prefix_cache.harness.problems import Problem
from tests.models.hybrid_prefix_cache.harness.servers import report_folder


def _findings(problems: Sequence[str]) -> list[dict]:
    """What the checks found, for a known failure's entry (harness.problems)."""
    return [p.as_json() for p in problems if isinstance(p, Problem) and p.kind]


def _gap(comparison: compare.Comparison | None) -> str:
    if comparison is None:
        return "-"
    return f"{'~' if comparison.divergence else ''}{comparison.gap:.3g}"


class CaseProblems:
    """What a case in progress and its record both say of its problems."""

    case_id: str
    units: deployment.Units | None
    turns: Sequence[compare.Turn]
    problems: Sequence[str]
    noise: paths.PathNoise | None

    def failures(self) -> list[str]:
        return [p for turn in self.turns for p in turn.problems] + list(self.problems)

    @property
    def ok(self) -> bool:
        return not self.failures()

    def explain(self) -> str:
        failures = self.failures()
        head = f"{self.case_id}: {len(failures)} problem(s)"
        return "\n".join([head, *failures, "", format_table(self)])


def format_table(case: CaseProblems) -> str:
    """Per turn: the hit, its recompute's tokens, the hit's gap to the request on its
    own path (``max|dlp|``; batched: its recompute alone on a batch-invariant server,
    its prompt's prefill step alone, or its batched cold twin), and across paths with
    its tolerance (``path|dlp|``, ``tol``; P/D: the relay against the decoder alone,
    exactly, else cold twin, within measured noise); ``~``: up to where samples part."""
    units = case.units
    geometry = f"hit unit {units.hit}, block {units.block}" if units else "no geometry"
    lines = [
        f"== {case.case_id}: {geometry}",
        f"{'conversation':<14} {'turn':>6} {'prompt':>6} {'expected':>8} "
        f"{'cached':>6} {'bound':>6} {'recompute':>9} {'tokens':>6} "
        f"{'max|dlp|':>9} {'path|dlp|':>9} {'tol':>8} {'s':>5}  verdict",
    ]
    for turn in case.turns:
        out, rec, compared = turn.output, turn.recompute, turn.comparisons
        same = "same" if out and rec and out.token_ids == rec.token_ids else "DIFF"
        own = next((c for c in compared if c.what.startswith("hit ")), None)
        across = next(
            (c for c in compared if not c.same_path or c.what.startswith("transfer")),
            None,
        )
        across = None if across is own else across
        tol = across.tolerance if across else own.tolerance if own else None
        verdict = "FAIL" if turn.problems else "notice" if turn.notices else "ok"
        lines.append(
            f"{turn.conversation or '-':<14} "
            f"{'resend' if turn.resend else turn.index:>6} {turn.prompt_len:>6} "
            f"{turn.expected:>8} {out.cached_tokens if out else '-':>6} "
            f"{turn.bound:>6} {rec.cached_tokens if rec else '-':>9} "
            f"{same if rec else '-':>6} {_gap(own):>9} {_gap(across):>9} "
            f"{'-' if tol is None else f'{tol:.3g}':>8} {turn.seconds:>5.1f}  "
            f"{verdict}"
        )
    if case.noise is not None:
        lines.append(str(case.noise))
    return "\n".join(lines)


def _sample(s: compare.Sample | None) -> dict | None:
    if s is None:
        return None
    return {
        "token_ids": s.token_ids,
        "token_logprobs": s.token_logprobs,
        "top_logprobs": [{str(k): v for k, v in top.items()} for top in s.top_logprobs],
        "cached_tokens": s.cached_tokens,
        "prompt_tokens": s.prompt_tokens,
    }


def _turn_json(t: compare.Turn) -> dict:
    out, rec = t.output, t.recompute
    return {
        "conversation": t.conversation,
        "turn": "resend" if t.resend else t.index,
        "prompt_len": t.prompt_len,
        "prev_len": t.prev_len,
        "expected": t.expected,
        "bound": t.bound,
        "cached": out.cached_tokens if out else None,
        "decoder_cached": out.decoder_hit if out else None,
        "max_logprob_diff": t.max_logprob_diff,
        "divergence": compare.first_divergence(out, rec) if out and rec else None,
        "seconds": round(t.seconds, 2),
        "hit": _sample(out),
        "recompute": _sample(rec),
        "twin": _sample(t.twin),
        "control": _sample(t.control),
        "more_controls": [_sample(c) for c in t.more_controls],
        "batched": t.batched,
        "batch_invariant": t.invariant,
        "prefill_step": t.prefill_step,
        "alone": _sample(t.alone),
        "mid_block": t.mid_block,
        "comparisons": [{**vars(c), "judged": c.judged} for c in t.comparisons],
        "problems": list(t.problems),
        "findings": _findings(t.problems),
        "notices": list(t.notices),
        "salt": t.salt,
        "prompt": list(t.prompt),
    }


@dataclass(frozen=True, repr=False)
class CaseRecord(CaseProblems):
    """Frozen when the case ends; one-line repr: pytest prints it after explain()."""

    case_id: str
    test: str = ""  # the pytest node that ran it, if any (dev/benchmark_cpu_tier.py)
    units: deployment.Units | None = None
    turns: tuple[compare.Turn, ...] = ()
    metrics: Mapping = field(default_factory=dict)
    problems: tuple[str, ...] = ()
    notices: tuple[str, ...] = ()
    startup_seconds: tuple[float, ...] = ()
    reused: bool | None = None  # None: no servers (their start failed)
    seconds: float = 0.0
    phase_seconds: Mapping[str, float] = field(default_factory=dict)
    outcome: str = ""
    # The summary's word where a known-failure table judged the outcome:
    # known xfail, known refusal, or FAIL (stale table, XPASS); else outcome.
    verdict: str = ""
    noise: paths.PathNoise | None = None  # what its cold controls measured
    serve: Mapping | None = None  # its servers, for the reproducer

    def __repr__(self) -> str:
        outcome = self.verdict or self.outcome
        return f"CaseRecord({self.case_id!r}: {outcome}, {len(self.turns)} turns)"

    def as_json(self) -> dict:
        return {
            "case_id": self.case_id,
            "test": self.test,
            "outcome": self.outcome,
            "verdict": self.verdict,
            "seconds": round(self.seconds, 2),
            "phase_seconds": {k: round(v, 2) for k, v in self.phase_seconds.items()},
            "server_startup_seconds": [round(s, 2) for s in self.startup_seconds],
            "servers_reused": self.reused,
            "units": None if self.units is None else vars(self.units),
            "turns": [_turn_json(t) for t in self.turns],
            "path_noise": None
            if self.noise is None
            else {**vars(self.noise), "tolerance": self.noise.tolerance},
            "metrics_deltas": dict(self.metrics),
            "problems": list(self.problems),
            "findings": _findings(self.problems),
            "notices": list(self.notices),
            "serve": None if self.serve is None else dict(self.serve),
        }


def serve_info(play) -> dict | None:
    """What a reproducer needs of a case's servers (None: it got none)."""
    if play is None:
        return None
    specs = [s.spec for s in play.servers if getattr(s, "spec", None) is not None]
    pd = play.deployment.prefill is not None
    params = dict(client.PREFILL_KV_TRANSFER_PARAMS) if pd else None
    vllm = sys.modules.get("vllm")
    return {
        "model": play.binding.model,
        "servers": [
            {
                "name": spec.name,
                "args": list(spec.args),
                "env": dict(spec.env),
                "side_channel_port": spec.side_channel_port,
            }
            for spec in specs
        ],
        "pd": pd,
        "offload": play.deployment.offload,
        "logprob_atol": play.recompute_atol,
        "compares_logprobs": play.deployment.compares_logprobs,
        "max_tokens": client.MAX_TOKENS,
        "logprobs": compare.NUM_LOGPROBS,
        "prefill_kv_transfer_params": params,
        "vllm_version": getattr(vllm, "__version__", None),
        "vllm_file": getattr(vllm, "__file__", None),
    }


def report(record: CaseRecord, summary: list[CaseRecord] | None = None) -> None:
    """Print its table, notices and problems, add it to ``summary``, save its JSON."""
    print("\n" + format_table(record))
    for notice in [n for t in record.turns for n in t.notices] + [*record.notices]:
        print(f"notice: {notice}")
    for problem in record.problems:
        print(f"problem: {problem}")
    if summary is not None:
        summary.append(record)
    path = report_folder() / f"{record.case_id}.json"
    path.write_text(json.dumps(record.as_json(), indent=1))
    if not record.ok:
        print(f"record: {path} (its reproducer: dev/suite.sh reproduce {path})")
