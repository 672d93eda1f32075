# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``.buildkite/scripts/install-kv-connectors.sh`` run for real against stubs
that record what they are asked to do, and, on this platform, a NIXL that
imports."""

import json
import shutil

import pytest
from prefix_cache_ci_install import (
    MOONCAKE_CASES,
    MOONCAKE_CU12,
    MOONCAKE_CU13,
    _fake_lock,
    _installed,
    _names,
    _requirements_pin,
    _script_setting,
    _site_run,
    _without_kv_lock,
    stubbed_run,
)
from vllm.platforms import current_platform

# No distributed state or device in-process: skip vLLM's global cleanup.
pytestmark = pytest.mark.skip_global_cleanup


@pytest.mark.parametrize(
    ("major", "requirements", "build", "other"), MOONCAKE_CASES, ids=("cu12", "cu13")
)
def test_install_script_checks_mooncake_on_cuda(
    tmp_path, major, requirements, build, other
):
    """A real run installs this major's build at its lock and then makes
    python3 load its engine and store, with that build at that version named
    as the only one allowed."""
    _without_kv_lock()
    result, python_calls, uv_calls = stubbed_run(tmp_path, f"cuda {major}")
    assert result.returncode == 0, result.stderr
    installs = [c for c in uv_calls if c[:2] == ["pip", "install"]]
    locked = _script_setting("MOONCAKE_VERSION")
    assert [c[-1] for c in installs if _names(c, build)] == [f"{build}=={locked}"]
    checks = [c for c in python_calls if "mooncake.engine" in c["script"]]
    assert len(checks) == 1, f"python3 was asked to load Mooncake {len(checks)} times"
    (check,) = checks
    assert check["argv"] == ["-", build, locked, MOONCAKE_CU12, MOONCAKE_CU13]
    for line in ("from mooncake.engine import", "from mooncake.store import"):
        assert line in check["script"]
    assert 'shutil.which("mooncake_master")' in check["script"]
    # NIXL is checked first, at the requirements' pin, and the Mooncake
    # check is the last call.
    assert python_calls[-1] is check
    assert "import nixl" in python_calls[-2]["script"]
    assert python_calls[-2]["argv"] == ["-", _requirements_pin(requirements)]

    failed, _, _ = stubbed_run(tmp_path / "fails", f"cuda {major}", "mooncake")
    assert failed.returncode == 1
    assert f"Mooncake ({build}) is not installed alone" in failed.stderr


def test_install_script_leaves_mooncake_off_cpu(tmp_path):
    """On CPU a real run installs and checks NIXL alone, at its lock."""
    result, python_calls, uv_calls = stubbed_run(tmp_path, "cpu -")
    assert result.returncode == 0, result.stderr
    assert uv_calls and python_calls
    assert not [c for c in uv_calls if "mooncake" in " ".join(c)], uv_calls
    assert not [c for c in python_calls if "mooncake" in json.dumps(c)]
    assert "import nixl" in python_calls[-1]["script"]
    assert python_calls[-1]["argv"] == ["-", _script_setting("CPU_NIXL_VERSION")]


def test_install_script_checks_the_lock_after_installing(tmp_path):
    """A real run installs a lock and then holds the environment to it: a
    package of the lock's input that the install did not bring to its
    version fails the run, naming it; where everything is as locked, nothing
    is installed, and NIXL and the lock's Mooncake build must import, at the
    lock's versions."""
    owned = ["nixl", "nixl-cu13", MOONCAKE_CU13]
    entries = {"nixl": "2.0", "nixl-cu13": "2.0", MOONCAKE_CU13: "1.0", "dep": "1"}
    lock = _fake_lock(tmp_path / "lock", entries, owned)
    site = tmp_path / "site"
    for name, version in entries.items():
        _installed(site, name, version)
    for module in ("nixl/__init__", "mooncake/__init__"):
        (site / f"{module}.py").parent.mkdir(parents=True, exist_ok=True)
        (site / f"{module}.py").write_text("")
    (site / "mooncake/engine.py").write_text("TransferEngine = object\n")
    (site / "mooncake/store.py").write_text("MooncakeDistributedStore = object\n")
    result, uv_calls = _site_run(tmp_path / "as-locked", "cuda 13", lock, site)
    assert result.returncode == 0, result.stdout + result.stderr
    assert not [c for c in uv_calls if "install" in c], uv_calls
    assert f"{MOONCAKE_CU13} 1.0\n" in result.stdout, result.stdout
    assert "nixl-cu13 2.0\n" in result.stdout, result.stdout

    # The stub uv installs nothing: nixl stays at 1.9.
    for old in site.glob("nixl-2.0.dist-info"):
        shutil.rmtree(old)
    _installed(site, "nixl", "1.9")
    result, uv_calls = _site_run(tmp_path / "not-taken", "cuda 13", lock, site)
    assert result.returncode == 1, result.stdout
    assert [c for c in uv_calls if "--require-hashes" in c], uv_calls
    assert f"not as {lock} locks them: nixl\n" in result.stderr, result.stderr


@pytest.mark.skipif(
    not current_platform.is_cpu(), reason="checks the CPU install of NIXL"
)
def test_nixl_installed_on_cpu():
    """install-kv-connectors.sh ran before this suite; NIXL must import."""
    from vllm.distributed import nixl_utils
    from vllm.distributed.kv_transfer.kv_connector.factory import (
        KVConnectorFactory,
    )

    connector = KVConnectorFactory.get_connector_class_by_name("NixlConnector")
    assert "Nixl" in connector.__name__, connector
    # vLLM's NIXL loader answers None when the nixl package does not import.
    assert nixl_utils.NixlWrapper is not None, "vLLM finds no usable NIXL"
    assert nixl_utils.nixl_agent_config is not None
