# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Model-agnostic harness for prefix-cache tests of hybrid models: a growing
conversation hits at least the previous prompt's last checkpoint on every
turn and equals a recompute under a fresh ``cache_salt``. A tier binds a
model (:class:`Binding`), lists what to deploy and how to match
(:class:`Deployment`, :class:`Mode`, a :class:`Matrix`), and runs::

    record = MATRIX.run(hybrid_suite, case_id, binding, deployment, mode)
    assert record.ok, record.explain()

This facade holds only what a binding uses. Every other name lives in the
module named for what it owns, each importing only those before it: problems,
rules, deployment, compare, paths, transfer, reconcile, known, clock, servers,
client, window, conversation, records, session, cases, workload (the
workloads themselves are the ``workloads`` package), matrix; plugin.
"""

from tests.models.hybrid_prefix_cache.harness.cases import Suite, run_case, run_resend
from tests.models.hybrid_prefix_cache.harness.client import cache_config
from tests.models.hybrid_prefix_cache.harness.deployment import (
    Binding,
    Deployment,
    Instance,
    Known,
    Mode,
    Units,
    cpu_offload,
    kv_connector,
    matrix_modes,
    multi_connector,
    server_args,
    with_serve_args,
    with_serve_env,
)
from tests.models.hybrid_prefix_cache.harness.matrix import (
    Matrix,
    case_seconds,
    servers_mark,
)
from tests.models.hybrid_prefix_cache.harness.problems import Finding, finding
from tests.models.hybrid_prefix_cache.harness.records import CaseRecord
from tests.models.hybrid_prefix_cache.harness.rules import (
    Drafting,
    exact_budget,
    holds_for,
)
from tests.models.hybrid_prefix_cache.harness.servers import ServerPool, server_specs
from tests.models.hybrid_prefix_cache.harness.workload import (
    InProcess,
    Workload,
    WorkloadRun,
)

__all__ = [
    "Binding",
    "CaseRecord",
    "Deployment",
    "Drafting",
    "Finding",
    "InProcess",
    "Instance",
    "Known",
    "Matrix",
    "Mode",
    "ServerPool",
    "Suite",
    "Units",
    "Workload",
    "WorkloadRun",
    "cache_config",
    "case_seconds",
    "cpu_offload",
    "exact_budget",
    "finding",
    "holds_for",
    "kv_connector",
    "matrix_modes",
    "multi_connector",
    "run_case",
    "run_resend",
    "server_args",
    "server_specs",
    "servers_mark",
    "with_serve_args",
    "with_serve_env",
]
