# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What a hybrid-model prefix-cache binding imports. Modules import only earlier ones:
problems, rules, deployment, compare, paths, reconcile, known, clock, servers, client,
window, conversation, records, session, cases, matrix; plugin."""

from tests.models.hybrid_prefix_cache.harness.cases import Suite as Suite
from tests.models.hybrid_prefix_cache.harness.cases import Workload as Workload
from tests.models.hybrid_prefix_cache.harness.cases import WorkloadRun as WorkloadRun
from tests.models.hybrid_prefix_cache.harness.cases import run_case as run_case
from tests.models.hybrid_prefix_cache.harness.cases import run_resend as run_resend
from tests.models.hybrid_prefix_cache.harness.client import cache_config as cache_config
from tests.models.hybrid_prefix_cache.harness.deployment import Binding as Binding
from tests.models.hybrid_prefix_cache.harness.deployment import Deployment as Deployment
from tests.models.hybrid_prefix_cache.harness.deployment import Instance as Instance
from tests.models.hybrid_prefix_cache.harness.deployment import Known as Known
from tests.models.hybrid_prefix_cache.harness.deployment import Mode as Mode
from tests.models.hybrid_prefix_cache.harness.deployment import Units as Units
from tests.models.hybrid_prefix_cache.harness.deployment import (
    cpu_offload as cpu_offload,
)
from tests.models.hybrid_prefix_cache.harness.deployment import (
    kv_connector as kv_connector,
)
from tests.models.hybrid_prefix_cache.harness.deployment import (
    matrix_modes as matrix_modes,
)
from tests.models.hybrid_prefix_cache.harness.deployment import (
    multi_connector as multi_connector,
)
from tests.models.hybrid_prefix_cache.harness.deployment import (
    server_args as server_args,
)
from tests.models.hybrid_prefix_cache.harness.deployment import (
    with_serve_args as with_serve_args,
)
from tests.models.hybrid_prefix_cache.harness.deployment import (
    with_serve_env as with_serve_env,
)
from tests.models.hybrid_prefix_cache.harness.matrix import Matrix as Matrix
from tests.models.hybrid_prefix_cache.harness.matrix import case_seconds as case_seconds
from tests.models.hybrid_prefix_cache.harness.matrix import servers_mark as servers_mark
from tests.models.hybrid_prefix_cache.harness.problems import finding as finding
from tests.models.hybrid_prefix_cache.harness.records import CaseRecord as CaseRecord
from tests.models.hybrid_prefix_cache.harness.rules import Drafting as Drafting
from tests.models.hybrid_prefix_cache.harness.rules import exact_budget as exact_budget
from tests.models.hybrid_prefix_cache.harness.rules import holds_for as holds_for
from tests.models.hybrid_prefix_cache.harness.servers import ServerPool as ServerPool
from tests.models.hybrid_prefix_cache.harness.servers import (
    server_specs as server_specs,
)
