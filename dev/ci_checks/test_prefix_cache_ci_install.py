# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``.buildkite/scripts/install-kv-connectors.sh`` in its dry-run mode: vLLM's
KV connector lock where the checkout has one, exactly, and elsewhere the
NIXL wheel variant and the Mooncake build of torch's CUDA version, locked."""

import re

import pytest
from prefix_cache_ci_area import ROOT
from prefix_cache_ci_install import (
    KV_LOCK,
    MOONCAKE_CASES,
    MOONCAKE_CU12,
    MOONCAKE_CU13,
    _canonical,
    _commands,
    _fake_lock,
    _index,
    _installed,
    _installs,
    _lock_install,
    _locked_packages,
    _names,
    _requirements_pin,
    _requires,
    _rocm_lock,
    _script_setting,
    _without_kv_lock,
    dry_run,
    lock_entries,
)

# No distributed state or device in-process: skip vLLM's global cleanup.
pytestmark = pytest.mark.skip_global_cleanup


@pytest.mark.parametrize(
    ("major", "requirements", "build", "other"), MOONCAKE_CASES, ids=("cu12", "cu13")
)
def test_install_script_installs_locked_versions_on_cuda(
    tmp_path, major, requirements, build, other
):
    """Without vLLM's KV connector lock: exactly NIXL at the requirements'
    pin in this CUDA major's variant, and this major's Mooncake build at the
    script's lock (within the requirements' range), each --no-deps; the
    requirements' unlocked rest, which upstream's own steps use, is named as
    not locked and installed last, apart, with torch held."""
    _without_kv_lock()
    result = dry_run(tmp_path, f"cuda {major}")
    assert result.returncode == 0, result.stderr
    commands = _commands(result)
    *locked, rest = _installs(commands)
    installed = {}
    for command in locked:
        installed.update(_locked_packages(command))
    assert "-r" in rest and "-c" in rest and "--no-deps" not in rest, rest
    pin, mooncake = _requirements_pin(requirements), _script_setting("MOONCAKE_VERSION")
    assert installed == {"nixl": pin, f"nixl-cu{major}": pin, build: mooncake}
    assert _requires(requirements, MOONCAKE_CU12)
    assert f"Mooncake for CUDA {major}: {build}\n" in result.stdout, result.stdout
    uninstalls = [c for c in commands if "uninstall" in c]
    other_nixl = "13" if major == "12" else "12"
    assert any(_names(c, f"nixl-cu{other_nixl}") for c in uninstalls), uninstalls
    # Both builds go (they share files) before this one is installed.
    (removal,) = [c for c in uninstalls if _names(c, build) or _names(c, other)]
    assert _names(removal, build) and _names(removal, other), removal
    (install,) = [c for c in _installs(commands) if _names(c, build)]
    assert _index(commands, removal) < _index(commands, install)
    assert "lmcache" in result.stdout.split("not locked (no lock in vLLM")[1], (
        result.stdout
    )


def test_install_script_keeps_mooncake_within_the_requirements(tmp_path):
    """A requirements range that excludes the locked Mooncake fails the
    script, which names both."""
    requirements = tmp_path / "kv.txt"
    requirements.write_text(f"nixl == 1.5.0\n{MOONCAKE_CU12} >= 99\n")
    result = dry_run(tmp_path / "run", "cuda 13", requirements)
    assert result.returncode == 1
    locked = _script_setting("MOONCAKE_VERSION")
    assert f"outside the locked Mooncake {locked}" in result.stderr, result.stderr


def test_install_script_installs_locked_versions_on_cpu(tmp_path):
    result = dry_run(tmp_path, "cpu -")
    assert result.returncode == 0, result.stderr
    (install,) = _installs(_commands(result))
    version = _script_setting("CPU_NIXL_VERSION")
    assert _locked_packages(install) == {"nixl": version, "nixl-cu12": version}


def test_install_script_installs_locked_versions_on_rocm(tmp_path):
    """The ROCm requirements at the versions of vLLM's ROCm test lock; a
    package the lock does not pin fails the script. Where vLLM has no ROCm
    KV connector requirements (0.34.0: its image holds them from the ROCm
    test lock), nothing is installed."""
    result = dry_run(tmp_path, "rocm -")
    assert result.returncode == 0, result.stderr
    if (ROOT / "requirements/kv_connectors_rocm.txt").is_file():
        (install,) = _installs(_commands(result))
        lock = _rocm_lock()
        names = [
            _canonical(re.split(r"[<>=!~;\[ ]", line, maxsplit=1)[0])
            for line in (ROOT / "requirements/kv_connectors_rocm.txt")
            .read_text()
            .splitlines()
            if line.strip() and not line.startswith(("#", "-"))
        ]
        assert _locked_packages(install) == {name: lock[name] for name in names}
    else:
        assert not _installs(_commands(result)), result.stdout
        assert "nothing to install" in result.stdout, result.stdout
    requirements = tmp_path / "rocm.txt"
    requirements.write_text("tblib\nnot-a-package-the-lock-pins\n")
    unlocked = dry_run(tmp_path / "unlocked", "rocm -", requirements)
    assert unlocked.returncode == 1
    assert "not-a-package-the-lock-pins: no version in" in unlocked.stderr


def test_install_script_rejects_an_unknown_cuda(tmp_path):
    cuda11 = dry_run(tmp_path, "cuda 11")
    assert cuda11.returncode == 1
    assert "no NIXL wheel variant for CUDA 11" in cuda11.stderr


def test_install_script_installs_the_lock(tmp_path):
    """Where the checkout has vLLM's KV connector lock (0.34.0 on), CUDA 13
    gets exactly it: into an environment that has none of it, every entry
    with its version and every hash, installed hash-checked and --no-deps
    from one file, and nothing else (no pin of the script's own, nothing
    unlocked); NIXL and Mooncake are then checked at the lock's versions."""
    if not KV_LOCK.is_file():
        pytest.skip(f"this checkout has no {KV_LOCK.name} (vLLM before 0.34.0)")
    site = tmp_path / "site"
    site.mkdir()
    result = dry_run(tmp_path / "run", "cuda 13", site=site)
    assert result.returncode == 0, result.stderr
    commands = _commands(result)
    assert not [c for c in commands if "uninstall" in c], commands
    lock = lock_entries(KV_LOCK.read_text())
    assert lock and all(hashes for _, hashes in lock.values()), "not a hash lock"
    assert lock_entries(_lock_install(result)) == lock
    assert f"Mooncake for CUDA 13: {MOONCAKE_CU13}\n" in result.stdout
    assert "not locked" not in result.stdout, result.stdout
    # On CUDA 12 the lock (CUDA 13's, as vLLM bakes it) is refused.
    cuda12 = dry_run(tmp_path / "cuda12", "cuda 12", site=site)
    assert cuda12.returncode == 1
    assert "locks the KV connectors for CUDA 13" in cuda12.stderr, cuda12.stderr


def test_install_script_installs_a_lock_over_what_is_installed(tmp_path):
    """A lock over an environment that has some of it: what is missing is
    installed, a package of the lock's input at another version is replaced,
    any other package at another version is left and named (the
    environment's, as vLLM's image leaves it), one at the lock's version is
    not touched; the other CUDA major's NIXL and Mooncake builds go first,
    and with the other Mooncake build, this one's (they share files)."""
    owned = ["nixl", "nixl-cu13", MOONCAKE_CU13]
    entries = {"nixl": "2.0", "nixl-cu13": "2.0", MOONCAKE_CU13: "1.0"}
    entries |= {"dep-kept": "1.0", "dep-same": "1.0", "dep-missing": "1.0"}
    lock = _fake_lock(tmp_path / "lock", entries, owned)
    site = tmp_path / "site"
    for name, version in (
        ("nixl", "1.9"),  # owned, another version: replaced
        ("nixl-cu13", "2.0"),  # at the lock's version
        ("nixl-cu12", "1.9"),  # the other variant
        (MOONCAKE_CU12, "0.9"),  # the other build
        (MOONCAKE_CU13, "1.0"),  # shares the other build's files
        ("dep-kept", "0.5"),
        ("dep-same", "1.0"),
    ):
        _installed(site, name, version)
    result = dry_run(tmp_path / "run", "cuda 13", lock, site)
    assert result.returncode == 0, result.stderr
    commands = _commands(result)
    (removal,) = [c for c in commands if "uninstall" in c]
    for build in ("nixl-cu12", MOONCAKE_CU12, MOONCAKE_CU13):
        assert _names(removal, build), removal
    assert not _names(removal, "nixl") and not _names(removal, "nixl-cu13")
    (install,) = _installs(commands)
    assert _index(commands, removal) < _index(commands, install)
    full = lock_entries(lock.read_text())
    planned = lock_entries(_lock_install(result))
    assert planned == {n: full[n] for n in ("nixl", MOONCAKE_CU13, "dep-missing")}
    assert "  dep-kept 0.5 (the lock's: 1.0)\n" in result.stdout, result.stdout

    # A lock entry without a hash, or one for another CUDA major, is refused.
    (lock.parent / "bare").mkdir()
    bare = lock.parent / "bare" / lock.name
    bare.write_text(lock.read_text() + "unhashed==1.0 \\\n    # via x\n")
    refused = dry_run(tmp_path / "bare", "cuda 13", bare, site)
    assert refused.returncode == 1
    assert "unhashed==1.0 has no --hash" in refused.stderr, refused.stderr
    cuda12 = dry_run(tmp_path / "cuda12", "cuda 12", lock, site)
    assert cuda12.returncode == 1
    assert "locks the KV connectors for CUDA 13" in cuda12.stderr, cuda12.stderr
