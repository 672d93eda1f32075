# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``pytest --collect-only`` run in this process."""

import pytest


class _Collected:
    def __init__(self) -> None:
        self.ids: list[str] = []

    def pytest_collection_finish(self, session) -> None:
        self.ids = [item.nodeid for item in session.items]


def collected_ids(args: list[str]) -> list[str]:
    """The node ids ``pytest --collect-only args`` (absolute paths) selects, in a
    second where a fresh interpreter spends ten or more importing vLLM again."""
    collected = _Collected()
    code = pytest.main(
        ["--collect-only", "-q", "-p", "no:cacheprovider", *args], plugins=[collected]
    )
    assert code == pytest.ExitCode.OK, f"collecting {args} ended with {code!r}"
    return collected.ids
