# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What a hybrid-model prefix-cache binding imports. Modules import only earlier ones:
problems, rules, deployment, compare, paths, transfer, reconcile, known, clock, servers,
client, window, conversation, records, session, cases, workload, matrix; plugin."""

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

__all__ = ["Suite", "run_case", "run_resend", "cache_config", "Binding", "Deployment"]
__all__ += ["Instance", "Known", "Mode", "Units", "cpu_offload", "kv_connector"]
__all__ += ["matrix_modes", "multi_connector", "server_args", "with_serve_args"]
__all__ += ["with_serve_env", "Matrix", "case_seconds", "servers_mark", "Finding"]
__all__ += ["finding", "CaseRecord", "Drafting", "exact_budget", "holds_for"]
__all__ += ["ServerPool", "server_specs", "InProcess", "Workload", "WorkloadRun"]
