# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The stand-in workers of a server (:class:`StandInWorker`) and what a completion's
response carries that the harness reads (:class:`Completion`)."""

from dataclasses import dataclass, field, fields

from vllm.distributed.kv_transfer.kv_connector.v1 import multi_connector
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import metadata as nixl
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import DraftTokenIds, KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.simple_kv_offload import metadata as offload

# Whether a runner's output maps request ids to indexes (0.33 and before); from
# 0.34 the scheduler goes by their req_ids order (v1/outputs.py ModelRunnerOutput).
_INDEXED_BY_MAP = "req_id_to_index" in {f.name for f in fields(ModelRunnerOutput)}


@dataclass
class Completion:
    request_id: str
    prompt: list[int]
    token_ids: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int | None = None
    kv_transfer_params: dict | None = None
    finished: bool = False


class StandInWorker:
    """A server's workers as its scheduler sees them: each token a function of the
    sequence so far (a hit and its recompute generate alike, as greedy decoding
    does), every draft rejected (one token a decode step), every KV transfer done
    in the step that asked: NIXL reads (the decoder reports it received, the
    prefiller it sent in its next step), CPU offload loads and stores (a store
    acknowledged by every rank, as ``SimpleCPUOffloadWorkerMetadata`` aggregates)."""

    def __init__(
        self, scheduler: Scheduler, token_ids: tuple[int, int], world_size: int
    ) -> None:
        self.scheduler, self.token_ids = scheduler, token_ids
        self.world_size = world_size
        # Requests of this server whose KV a peer finished reading.
        self.pending_sends: set[str] = set()
        self.peers: dict[str, StandInWorker] = {}

    def token(self, request: Request) -> int:
        low, high = self.token_ids
        tail = request.all_token_ids[-8:]
        mix = sum((i + 1) * t for i, t in enumerate(tail)) + len(request.all_token_ids)
        return low + mix % (high - low)

    def execute(self, output) -> ModelRunnerOutput:
        req_ids = list(output.num_scheduled_tokens)
        requests = [self.scheduler.requests[req_id] for req_id in req_ids]
        sampled = [[] if r.is_prefill_chunk else [self.token(r)] for r in requests]
        index = {}
        if _INDEXED_BY_MAP:
            index["req_id_to_index"] = {req_id: i for i, req_id in enumerate(req_ids)}
        return ModelRunnerOutput(
            req_ids=req_ids,
            sampled_token_ids=sampled,
            kv_connector_output=self.transfers(output.kv_connector_metadata),
            **index,
        )

    def drafts(self, output) -> DraftTokenIds | None:
        """K drafts per request that sampled a token (a synchronous
        scheduler takes them after the step, ``EngineCore.post_step``)."""
        num_spec = self.scheduler.num_spec_tokens
        if not num_spec:
            return None
        requests = self.scheduler.requests
        req_ids = [
            req_id
            for req_id in output.num_scheduled_tokens
            if req_id in requests
            and not requests[req_id].is_finished()
            and not requests[req_id].is_prefill_chunk
        ]
        return DraftTokenIds(req_ids, [[self.token_ids[0]] * num_spec for _ in req_ids])

    def transfers(self, metadata) -> KVConnectorOutput | None:
        if metadata is None:
            return None
        received: set[str] = set()
        multi = isinstance(metadata, multi_connector.MultiKVConnectorMetadata)
        parts = metadata.metadata if multi else (metadata,)
        metas = [self._transfer(part, received) for part in parts]
        combined = None if multi else metas[0]
        if multi and any(m is not None for m in metas):
            combined = multi_connector.MultiKVConnectorWorkerMetadata(tuple(metas))
        sent, self.pending_sends = self.pending_sends, set()
        return KVConnectorOutput(
            finished_sending=sent or None,
            finished_recving=received or None,
            kv_connector_worker_meta=combined,
        )

    def _transfer(self, metadata, received: set[str]):
        if isinstance(metadata, nixl.NixlConnectorMetadata):
            for req_id, meta in metadata.reqs_to_recv.items():
                if meta.awaiting_kvs:
                    received.add(req_id)
                if meta.remote is not None:
                    peer = self.peers.get(meta.remote.engine_id)
                    assert peer is not None, f"no prefiller {meta.remote.engine_id}"
                    peer.pending_sends.add(meta.remote.request_id)
            return None
        if isinstance(metadata, offload.SimpleCPUOffloadMetadata):
            loads = metadata.load_event_to_reqs
            if metadata.load_event >= 0:
                received.update(loads.get(metadata.load_event, ()))
            if metadata.store_event >= 0:
                return offload.SimpleCPUOffloadWorkerMetadata(
                    {metadata.store_event: self.world_size}
                )
            return None
        raise NotImplementedError(f"no stand-in worker for {type(metadata).__name__}")
