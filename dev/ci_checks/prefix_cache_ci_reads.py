# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What the suite's files read of vLLM, as Buildkite triggers: what they
import, name, count, call and configure, and the drafters' code."""

import ast
import inspect
import re

from prefix_cache_ci_area import ROOT, VLLM_SOURCE_ROOT, covered

# A vLLM path as the suite's text names one: under vllm/, or under one of
# vLLM's top folders (not models/, which names the suite's tests/models/).
NAMED_PATH = re.compile(
    r"(?<![\w/.])(?:vllm/([\w/]*\w(?:\.py)?)|((?:v1|distributed|entrypoints|"
    r"model_executor|config|engine|attention)/[\w/]*\w(?:\.py)?))"
)
# What the suite imports of vLLM to run, not to check (configs, argument
# parsing, platform, helpers): a change there shows in every vLLM step.
USED_NOT_CHECKED = (
    "vllm/config/",
    "vllm/engine/arg_utils.py",
    "vllm/entrypoints/cli/",
    "vllm/model_executor/models/",
    "vllm/platforms/",
    "vllm/sampling_params.py",
    "vllm/utils/",
    "vllm/v1/structured_output/",
)
METRIC_SUFFIXES = ("_total", "_count", "_sum", "_bucket", "_created")


def _vllm_path(path: str) -> str | None:
    """``path`` under vllm/ as a trigger (a folder ends in /), if vLLM has it."""
    path = path.removeprefix("vllm/").rstrip("/")
    full = VLLM_SOURCE_ROOT / "vllm" / path
    if full.is_dir():
        return f"vllm/{path}/"
    if full.is_file():
        return f"vllm/{path}"
    return None


def _module_path(module: str) -> str | None:
    """The file (or package folder) of a vllm module, as a trigger."""
    relative = module.replace(".", "/")
    for candidate in (f"{relative}.py", f"{relative}/"):
        if (found := _vllm_path(candidate)) is not None:
            return found
    return None


def _imported_modules(node: ast.ImportFrom) -> list[str]:
    """The vllm modules that ``from M import a, b`` reads: a submodule
    imported by name (``from vllm.v1.engine import output_processor``) is
    its own module, not its package's ``__init__``."""
    found = []
    for alias in node.names:
        module = f"{node.module}.{alias.name}"
        if _module_path(module) is None:
            module = node.module or ""
        if module not in found:
            found.append(module)
    return found


def _vllm_files_with(literal: str, under: str = "") -> set[str]:
    """The vLLM files (under ``under``) whose text holds ``literal``."""
    root = VLLM_SOURCE_ROOT / "vllm" / under
    return {
        path.relative_to(VLLM_SOURCE_ROOT).as_posix()
        for path in root.rglob("*.py")
        if literal in path.read_text(errors="replace")
    }


def _vllm_files_serving(route: str) -> set[str]:
    """The entrypoint files that register ``route`` (a call's first argument),
    not every file naming it (0.34.0's run_batch.py compares URLs with it)."""
    found = set()
    for path in _vllm_files_with(f'"{route}"', "entrypoints"):
        tree = ast.parse((VLLM_SOURCE_ROOT / path).read_text(errors="replace"))
        for node in ast.walk(tree):
            first = node.args[0] if isinstance(node, ast.Call) and node.args else None
            if isinstance(first, ast.Constant) and first.value == route:
                found.add(path)
                break
    return found


# Where the drafter rule comes from (SpeculativeConfig.use_eagle_block_drop),
# with the drafter configs it imports (0.34.0: in vllm/v1/worker/gpu/).
SPECULATIVE_CONFIG = "vllm/config/speculative.py"


def drafter_configs() -> dict[str, str]:
    """The modules of vLLM's spec-decode packages that SpeculativeConfig
    imports (of the vLLM under test), as triggers: {path: why}."""
    tree = ast.parse((VLLM_SOURCE_ROOT / SPECULATIVE_CONFIG).read_text())
    found = {}
    for node in ast.walk(tree):
        module = node.module or "" if isinstance(node, ast.ImportFrom) else ""
        if "spec_decode" in module.split(".") and (path := _module_path(module)):
            found[path] = f"{SPECULATIVE_CONFIG} imports {module}"
    return found


def _asks_speculative_config(node: ast.ImportFrom) -> bool:
    names = {alias.name for alias in node.names}
    return node.module == "vllm.config.speculative" or (
        node.module == "vllm.config" and "SpeculativeConfig" in names
    )


def _connector_module(name: str) -> str:
    """The module vLLM's connector factory loads for connector ``name``
    (vllm/distributed/kv_transfer/kv_connector/factory.py registers each
    with a lazy loader that holds its module path)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import (
        KVConnectorFactory,
    )

    loader = KVConnectorFactory._registry[name]
    return inspect.getclosurevars(loader).nonlocals["module_path"]


def vllm_reads(files: set[str], named: bool = True) -> dict[str, str]:
    """What the suite's ``files`` read of vLLM, as triggers: {path: why}.
    The vLLM modules they import (less USED_NOT_CHECKED, but with the
    drafter configs that SpeculativeConfig imports, where they ask it), the
    files they name (``named``), the files defining the /metrics counters
    they read, the files serving the routes they call (``url_for``) and the
    connectors they configure (``kv_connector``)."""
    reads: dict[str, str] = {}
    for file in sorted(files):
        text = (ROOT / file).read_text()
        tree = ast.parse(text)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                "vllm."
            ):
                for module in _imported_modules(node):
                    path = _module_path(module)
                    if path and not covered(path, list(USED_NOT_CHECKED)):
                        reads.setdefault(path, f"{file} imports {module}")
                if _asks_speculative_config(node):
                    for path, why in drafter_configs().items():
                        reads.setdefault(path, f"{file} asks SpeculativeConfig: {why}")
            if isinstance(node, ast.Call) and node.args:
                first = node.args[0]
                if not isinstance(first, ast.Constant) or not isinstance(
                    first.value, str
                ):
                    continue
                called = getattr(node.func, "attr", getattr(node.func, "id", ""))
                if called == "url_for":
                    route = f"/{first.value}"
                    found = _vllm_files_serving(route)
                    assert found, f"{file} calls {route}, which vLLM serves nowhere"
                    for path in found:
                        reads.setdefault(path, f"{file} calls {route}")
                elif called == "kv_connector":
                    path = _module_path(_connector_module(first.value))
                    assert path, first.value
                    reads.setdefault(path, f"{file} configures {first.value}")
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                metric = re.fullmatch(r"vllm:\w+", node.value)
                if metric:
                    base = node.value
                    for suffix in METRIC_SUFFIXES:
                        base = base.removesuffix(suffix)
                    found = _vllm_files_with(f'"{base}"')
                    assert found, (
                        f"{file} reads {node.value}, which vLLM defines nowhere"
                    )
                    for path in found:
                        reads.setdefault(path, f"{file} reads {node.value}")
        if named:
            for match in NAMED_PATH.finditer(text):
                path = _vllm_path(match.group(1) or match.group(2))
                # vllm/__init__.py names the package (what a reproducer must
                # not import), not where a rule comes from.
                if path and path != "vllm/__init__.py":
                    reads.setdefault(path, f"{file} names {match.group(0)}")
    return reads


def _uncovered(step: dict, reads: dict[str, str]) -> list[str]:
    listed = step["source_file_dependencies"]
    return [
        f"{path} ({why})" for path, why in reads.items() if not covered(path, listed)
    ]


def drafter_code(method: str) -> list[str]:
    """The code of a speculative method's drafter, as triggers: what vLLM's
    spec-decode folders hold under the method's name (DSpark's is
    vllm/v1/worker/gpu/spec_decode/dspark/ in 0.32.0 to 0.34.0)."""
    found = []
    for folder in sorted((VLLM_SOURCE_ROOT / "vllm").rglob("spec_decode")):
        for path in sorted(folder.glob(f"{method}*")):
            if path.stem == method:
                found.append(_vllm_path(path.relative_to(VLLM_SOURCE_ROOT).as_posix()))
    return found
