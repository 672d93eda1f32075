# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Wheel and archive helpers of the GPU bundle: trimming a wheel with its
RECORD kept consistent, checking a RECORD, and deterministic tars split into
parts."""

import base64
import csv
import hashlib
import io
import re
import tarfile
import zipfile
from pathlib import Path

CHUNK = 1 << 20


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            digest.update(block)
    return digest.hexdigest()


def record_hash(data: bytes) -> str:
    """A RECORD hash field: urlsafe base64 of the sha256, unpadded (PEP 376)."""
    raw = hashlib.sha256(data).digest()
    return "sha256=" + base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def record_name(zf: zipfile.ZipFile) -> str:
    return next(
        n
        for n in zf.namelist()
        if n.count("/") == 1 and n.endswith(".dist-info/RECORD")
    )


def trim_wheel(
    src: Path, dst: Path, rules: list[dict[str, str]]
) -> list[dict[str, object]]:
    """Copy wheel ``src`` to ``dst`` without the files that a rule's ``pattern``
    (a regex on the whole path) matches, and drop their RECORD rows.

    Returns one entry per trimmed file (path, size, rule). A rule that
    matches nothing is an error: the wheel is not the one it was written for.
    """
    compiled = [(re.compile(r["pattern"]), r["pattern"]) for r in rules]
    trimmed: list[dict[str, object]] = []
    used: set[int] = set()
    with zipfile.ZipFile(src) as zin:
        record = record_name(zin)
        keep = []
        for info in zin.infolist():
            hit = next(
                (
                    i
                    for i, (rx, _) in enumerate(compiled)
                    if rx.fullmatch(info.filename)
                ),
                None,
            )
            if hit is None:
                keep.append(info)
                continue
            used.add(hit)
            trimmed.append(
                {
                    "path": info.filename,
                    "size": info.file_size,
                    "rule": compiled[hit][1],
                }
            )
        stale = [r["pattern"] for i, r in enumerate(rules) if i not in used]
        if stale:
            raise ValueError(f"trim rules match nothing in {src.name}: {stale}")
        gone = {t["path"] for t in trimmed}
        rows = list(csv.reader(io.StringIO(zin.read(record).decode())))
        kept_rows = [row for row in rows if row and row[0] not in gone]
        buf = io.StringIO()
        csv.writer(buf, lineterminator="\n").writerows(kept_rows)
        tmp = dst.with_name(dst.name + ".partial")
        # Each kept member keeps its name, date and mode, so the same input
        # gives the same bytes.
        with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as zout:
            for info in keep:
                data = buf.getvalue().encode() if info.filename == record else None
                if data is None:
                    data = zin.read(info)
                out = zipfile.ZipInfo(info.filename, info.date_time)
                out.external_attr = info.external_attr
                out.compress_type = zipfile.ZIP_DEFLATED
                zout.writestr(out, data)
        tmp.replace(dst)
    return trimmed


def check_record(path: Path) -> list[str]:
    """What is wrong with a wheel's RECORD: files not listed, rows for files
    that are not there, hashes or sizes that differ."""
    problems = []
    with zipfile.ZipFile(path) as zf:
        record = record_name(zf)
        rows = {
            row[0]: row
            for row in csv.reader(io.StringIO(zf.read(record).decode()))
            if row
        }
        names = [n for n in zf.namelist() if not n.endswith("/")]
        for name in names:
            row = rows.pop(name, None)
            if row is None:
                problems.append(f"{path.name}: {name} is not in RECORD")
            elif name != record:
                data = zf.read(name)
                if row[1] != record_hash(data) or row[2] != str(len(data)):
                    problems.append(f"{path.name}: RECORD's hash or size of {name}")
        problems += [f"{path.name}: RECORD lists missing {n}" for n in sorted(rows)]
    return problems


def _tarinfo(name: str, size: int) -> tarfile.TarInfo:
    # No times, owners or modes from this machine: the same wheels give the
    # same tar.
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = size, 0o644, 0
    return info


def write_tar(dst: Path, files: list[Path], folder: str = "wheels") -> None:
    with tarfile.open(dst, "w", format=tarfile.PAX_FORMAT) as tar:
        for path in sorted(files, key=lambda p: p.name):
            with open(path, "rb") as f:
                tar.addfile(_tarinfo(f"{folder}/{path.name}", path.stat().st_size), f)


def split(src: Path, out_dir: Path, first: int, part_bytes: int) -> list[Path]:
    """Cut ``src`` into ``part-NN`` files of at most ``part_bytes``, numbered
    from ``first``."""
    parts = []
    with open(src, "rb") as f:
        while True:
            part = out_dir / f"part-{first + len(parts):02d}"
            written = 0
            with open(part, "wb") as out:
                while written < part_bytes:
                    block = f.read(min(CHUNK, part_bytes - written))
                    if not block:
                        break
                    out.write(block)
                    written += len(block)
            if written == 0:
                part.unlink()
                break
            parts.append(part)
    return parts
