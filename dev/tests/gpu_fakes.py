# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Fake wheels for dev/tests/test_gpu_bundle.py: a vLLM with the files the
trim rules cut, its requirements' world, NIXL, and a config over them."""

import base64
import hashlib
import random
import zipfile
from pathlib import Path

VERSION = "9.9.0"
TRIMMED = [
    "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so",
    "vllm/vllm-rs",
    "vllm/third_party/fmha_sm100/attn.py",
]
# Kept: the machine's Python; and another Python's, whose rule names older
# releases than VERSION.
KEPT_SO = "vllm/third_party/deep_gemm/_C.cpython-312-x86_64-linux-gnu.so"
OTHER_RELEASE_SO = "vllm/third_party/deep_gemm/_C.cpython-310-x86_64-linux-gnu.so"


def record_hash(data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest())
    return "sha256=" + digest.rstrip(b"=").decode()


def make_wheel(dest: Path, name: str, version: str, requires=(), files=None) -> Path:
    """A pure wheel with a consistent RECORD."""
    dist = name.replace("-", "_")
    info = f"{dist}-{version}.dist-info"
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    extras = {r.split("extra == ")[1].strip("'\"") for r in requires if "extra ==" in r}
    meta += "".join(f"Provides-Extra: {e}\n" for e in sorted(extras))
    meta += "".join(f"Requires-Dist: {r}\n" for r in requires)
    wheel = "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
    entries = dict(files or {f"{dist}/__init__.py": b""})
    entries[f"{info}/METADATA"] = meta.encode()
    entries[f"{info}/WHEEL"] = (wheel + "Tag: py3-none-any\n").encode()
    record = "".join(f"{n},{record_hash(d)},{len(d)}\n" for n, d in entries.items())
    entries[f"{info}/RECORD"] = (record + f"{info}/RECORD,,\n").encode()
    path = dest / f"{dist}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for n, d in entries.items():
            zf.writestr(zipfile.ZipInfo(n, (2020, 1, 1, 0, 0, 0)), d)
    return path


def fake_index(dest: Path) -> Path:
    """A fake vLLM and its world, as wheels; what each one exercises is beside it."""
    rng = random.Random(0)
    noise = rng.randbytes  # incompressible, so the tar spans several parts
    vllm_files = {
        "vllm/__init__.py": f'__version__ = "{VERSION}"\n'.encode(),
        "vllm/payload.bin": noise(300_000),
        KEPT_SO: noise(1000),
        OTHER_RELEASE_SO: noise(1000),
        **{p: noise(2000) for p in TRIMMED},
    }
    vllm = make_wheel(
        dest,
        "vllm",
        VERSION,
        [
            "dep-a>=1.0",  # two versions offered: one travels
            'dep-b; python_version > "3.11"',  # true on the machine's 3.12
            'dep-old; python_version < "3.12"',  # false there
            "dep-c[fancy]",  # an extra, whose dependency travels
            'zen-thing; extra == "zen"',  # an extra of vLLM, not asked for
            "torch==2.14.0",  # present 2.11.0, kept by the config (route 1)
            "numpy<2.4",  # present 2.5.2: refused, so pip's 2.3.0 travels
            "click",  # present, version unknown
            "heavy-opt",  # declared optional: never resolved
            "gone-opt==1.0",  # declared optional, and not in the index at all
            "hub>=2",  # present 1.0 refused; the present tf 1.0 needs hub<2
            "tf",  # so pip cannot keep tf 1.0 and says so: tf 1.1 travels
            "cfg>=1",  # present 1.0 satisfies: stays
            "dsl",  # excluded for older releases only: travels, with its .pth
        ],
        vllm_files,
    )
    for name, version, requires in [
        ("dep-a", "1.0", ["dep-e"]),
        ("dep-a", "1.1", ["dep-e"]),
        ("dep-b", "1.0", []),
        ("dep-old", "1.0", []),
        ("dep-c", "1.0", ['dep-d; extra == "fancy"']),
        ("dep-d", "1.0", []),
        ("dep-e", "1.0", ["numpy"]),
        ("zen-thing", "1.0", []),
        ("heavy-opt", "1.0", ["heavy-only", "dep-a"]),
        ("heavy-only", "1.0", []),
        ("torch", "2.11.0", []),
        ("torch", "2.14.0", ["tri~=3.8"]),  # route 2 carries it and its tri
        ("tri", "3.6.0", []),
        ("tri", "3.8.0", []),
        ("hub", "1.0", []),
        ("hub", "2.0", []),
        ("tf", "1.0", ["hub<2", "cfg"]),
        ("tf", "1.1", ["hub>=2", "cfg"]),
        ("cfg", "1.0", []),
        ("numpy", "2.3.0", []),
        ("numpy", "2.5.2", []),
        ("click", "8.0", []),
        ("nixl", "1.0.0", ["nixl-cu12==1.0.0", "nixl-cu13==1.0.0"]),
        ("nixl-cu12", "1.0.0", ["torch"]),
    ]:
        make_wheel(dest, name, version, requires)
    # Its .pth puts a folder of its own on sys.path, as the CuTe DSL's does.
    pth = b"import os, sys, dsl; sys.path.insert(0, os.path.join(dsl.__path__[0], 'p'))"
    make_wheel(
        dest,
        "dsl",
        "1.0",
        [],
        {"dsl/__init__.py": b"", "dsl/p/dsl_mod/__init__.py": b"", "dsl.pth": pth},
    )
    make_wheel(
        dest,
        "nixl-cu13",
        "1.0.0",
        ["torch", "numpy"],
        {"nixl_cu13/__init__.py": b"", "nixl_cu13/lib.so": noise(50_000)},
    )
    return vllm


def fake_config(path: Path, real: dict) -> Path:
    """The real machine and trim rules; a fake world's present and excluded."""
    lines = [
        f'vllm = "{VERSION}"',
        'nixl = ["nixl==1.0.0", "nixl-cu13==1.0.0"]',
        f"part_mib = {real['part_mib']}",
        "[machine]",
        *(f'{k} = "{v}"' for k, v in real["machine"].items() if k != "markers"),
        "[machine.markers]",
        *(f'{k} = "{v}"' for k, v in real["machine"]["markers"].items()),
        "[present]",
        'unversioned = ["click"]',
        "[present.versions]",
        'torch = "2.11.0"',
        'numpy = "2.5.2"',
        'tri = "3.6.0"',
        'hub = "1.0"',
        'tf = "1.0"',
        'cfg = "1.0"',
        "[kept]",
        'torch = "the torch there serves, in the test"',
        "[excluded]",
        'heavy-opt = "heavy and optional, in the test"',
        'gone-opt = "pinned to a release the index lacks, in the test"',
        'nixl-cu12 = "the other CUDA build"',
        'dsl = { releases = "<0.1", reason = "not needed before, in the test" }',
    ]
    for rule in real["trim"]:
        lines += [
            "[[trim]]",
            f"pattern = '{rule['pattern']}'",
            f'reason = "{rule["reason"]}"',
            *([f'releases = "{rule["releases"]}"'] if "releases" in rule else []),
        ]
    path.write_text("\n".join(lines) + "\n")
    return path
