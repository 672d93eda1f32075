# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A client aborts a cold prefill mid-way and retries: the retry resumes from what the
aborted steps wrote and no further (vLLM #56525 loaded a state no step wrote)."""

import random
import time

import tests.models.hybrid_prefix_cache.harness.rules as rules
from tests.models.hybrid_prefix_cache import harness
from tests.models.hybrid_prefix_cache.harness import client, conversation, reconcile
from tests.models.hybrid_prefix_cache.harness.compare import Turn

# The client gives up after this fraction of a cold request's time on the
# same server; a try that missed mid-prefill waits twice as long or half.
ABORT_AFTER_FRACTION = 0.25
ABORT_ATTEMPTS = 4


def abort_retry_length(units: harness.Units, budget: int) -> int:
    """The real server's prompt: its checkpoint, the last block boundary within
    ``budget``, ends the first chunk (Scheduler._mamba_block_aligned_split,
    last_cache_position); the tail takes a second step."""
    return budget // units.block * units.block + rules.FIRST_PROMPT_TAIL


def abort_landing(queried: float, first: float, length: int, answered: int = 1) -> str:
    """From the counters over the aborted request and the ``answered`` ones after
    it: prefix_cache_queries count a prompt at admission, first tokens a prefill."""
    if queried < (answered + 1) * length:
        return "before admission"
    if first > answered:
        return "after the prefill"
    return "mid-prefill"


def abort_checkpoint(
    landed: str, prompt_len: int, units: harness.Units, drops: bool
) -> int:
    """Nothing where the abort preceded admission, else the prompt's checkpoint: the
    first chunk published it when scheduled (MambaManager.cache_blocks), and a
    synchronous engine ran that step before it took the abort (EngineCore.step)."""
    if landed == "before admission":
        return 0
    return rules.prompt_end_checkpoint(prompt_len, units.hit, drops)


def play(run: harness.WorkloadRun) -> harness.CaseRecord:
    """The retry is played as a turn; the prompt's checkpoint ends its first chunk
    under the budget vLLM resolves for the caching instance."""
    __tracebackhide__ = True
    binding, deployment, mode = run.binding, run.deployment, run.mode
    with run.session() as case:
        budget = run.needs_in_process().budget(deployment, mode)
        with case.serve(run) as p:
            servers, model, units = p.servers, binding.model, p.units
            caching, pd = servers[0], len(servers) > 1
            seen = abort_retry_length(units, budget)
            length = seen + deployment.cache_backoff
            rng = random.Random(run.case_id)
            prompt = conversation.random_tokens(rng, binding.token_ids, length)
            clocks = [Turn("clock", i, length, 0, 0, prompt=prompt) for i in range(2)]
            for clock in clocks:
                clock.salt = conversation.fresh_salt("clock")
                case.add(clock)
                start = time.monotonic()
                clock.output = client.send(servers, model, prompt, clock.salt)
                clock.seconds = time.monotonic() - start
            took = min(clock.seconds for clock in clocks)
            after = ABORT_AFTER_FRACTION * took
            # Under P/D, the client gives up on the prefill leg.
            transfer = client.PREFILL_KV_TRANSFER_PARAMS
            leg = {"max_tokens": 1, "kv_transfer_params": transfer} if pd else {}
            counter = reconcile.REQUESTS_DONE
            for attempt in range(ABORT_ATTEMPTS):
                before = client.read_counters(caching)
                salt = conversation.fresh_salt("abort")
                answered = client.give_up(caching, model, prompt, salt, after, **leg)
                if answered is not None:
                    if pd:
                        # Its decode leg follows, as through the deployment.
                        params = answered.kv_transfer_params
                        answered = client.complete(
                            servers[-1], model, prompt, salt, kv_transfer_params=params
                        )
                    # Answered before the client gave up: a cold request.
                    case.add(Turn("answered", attempt, length, 0, 0, output=answered))
                planned = rules.PlannedTurn(attempt, length, length)
                retry = conversation.planned_turn(p, "retry", planned)
                case.add(retry)
                conversation.send_turn(p, retry, prompt, salt)
                # Counted once the retry's (and its twin's) stats are exported.
                sent = 1 + (retry.twin is not None)
                done = (before[counter] or 0.0) + sent + (answered is not None)
                now = client.poll_counters(caching, counter, lambda v, d=done: v >= d)
                moved = reconcile.counter_deltas(now, before)
                landed = "answered"
                if answered is None:
                    queried = moved[reconcile.PREFIX_QUERIES] or 0.0
                    first = moved[reconcile.FIRST_TOKENS] or 0.0
                    landed = abort_landing(queried, first, seen, sent)
                    if landed != "before admission":
                        entry = reconcile.aborted_entry(seen)
                        case.window.book_unanswered(caching, entry)
                retry.expected = abort_checkpoint(landed, seen, units, mode.drops_unit)
                conversation.recompute_turn(p, retry)
                case.add(
                    notice=f"attempt {attempt}: the client gave up after "
                    f"{after * 1e3:.0f} ms (a cold request took {took * 1e3:.0f} "
                    f"ms): {landed}; the retry cached {retry.restored}"
                )
                if landed == "mid-prefill":
                    break
                after = after * 2 if landed == "before admission" else after / 2
            else:
                case.add(
                    problem=f"abort-retry: no abort of the {seen}-token prompt landed "
                    f"mid-prefill in {ABORT_ATTEMPTS} attempts (the notices say "
                    f"where each did)"
                )
            conversation.finish_turns(p, case.turns)
            if not case.ok:
                chunk = f"its first chunk of {budget} tokens a step"
                detail = f"a {length}-token prompt, {chunk} ending on its checkpoint"
                case.add(problem=WORKLOAD.failure(detail))
    assert case.record is not None
    return case.record


WORKLOAD = harness.Workload(
    "abort-retry",
    "a retry after an abort matches its recompute",
    "v1/core/sched/scheduler.py Scheduler.finish_requests, "
    "v1/core/single_type_kv_cache_manager.py MambaManager.cache_blocks (a state is "
    "published when its chunk is scheduled), v1/engine/core.py "
    "EngineCore.step_with_batch_queue (the steps scheduled before the abort complete), "
    "MambaManager.get_num_blocks_to_allocate (a retry admitted beside the original is "
    "held back from a state published in its own step, cached_blocks_this_step); on a "
    "real server, EngineCore.step (a synchronous engine runs the step it scheduled "
    "before it takes the abort)",
    play=play,
)
