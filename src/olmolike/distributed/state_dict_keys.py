"""Editing nested state dicts by dotted keys (OLMo-core's helpers of the same names).

A dotted key joins the names from the top of a nested state dict down to a value, e.g.
``"model.blocks.0.weight"`` or ``"optim.state.blocks.0.weight.exp_avg"``. Parameter names
contain dots themselves, so these helpers walk the dicts rather than split the keys.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Set
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata

__all__ = ["merge_state_dicts", "prune_state_dict", "swap_param_keys"]

log = logging.getLogger(__name__)


def _flat_items(
    state: dict[str, Any], prefix: str = ""
) -> Iterator[tuple[str, dict[str, Any], str]]:
    """``(flat key, parent dict, key in parent)`` of every non-dict value, depth first."""
    for key, value in list(state.items()):
        flat = f"{prefix}{key}"
        if isinstance(value, dict):
            yield from _flat_items(value, f"{flat}.")
        else:
            yield flat, state, key


def prune_state_dict(state_dict: dict[str, Any], allowed_keys: Set[str]) -> set[str]:
    """Remove from the nested ``state_dict`` every value whose dotted key is not allowed.

    Keys join the nested names with dots (``"model.blocks.0.weight"``). Dicts emptied this way
    stay, as empty dicts. Returns the dotted keys removed.
    """
    pruned = set()
    for flat, parent, key in list(_flat_items(state_dict)):
        if flat not in allowed_keys:
            del parent[key]
            pruned.add(flat)
    return pruned


def merge_state_dicts(lhs: dict[str, Any], rhs: dict[str, Any]) -> None:
    """Add to ``lhs``, in place, every value of ``rhs`` that ``lhs`` does not have.

    Nested dicts merge level by level; where both have a value, ``lhs`` keeps its own.
    """
    for key, value in rhs.items():
        if key not in lhs:
            lhs[key] = value
        elif isinstance(lhs[key], dict) and isinstance(value, dict):
            merge_state_dicts(lhs[key], value)


def swap_param_keys(
    state_dict: dict[str, Any],
    key_mapping: Mapping[str, str],
    metadata: Metadata | None = None,
    reverse: bool = False,
    quiet: bool = False,
) -> None:
    """Rename parameters in a ``{"model": ..., "optim": ...}`` state dict, in place.

    ``key_mapping`` maps a current parameter name to its name in a checkpoint; each one is
    renamed in ``"model"`` and in the optimizer state (nested or flattened), so the state
    dict can load from (or, ``reverse=True``, come back from) that checkpoint. With
    ``metadata`` (of the checkpoint), only names the checkpoint holds are renamed.
    """
    for current, saved in key_mapping.items():
        if metadata is not None and f"model.{saved}" not in metadata.state_dict_metadata:
            continue
        old, new = (saved, current) if reverse else (current, saved)
        model = state_dict["model"]
        if old not in model:
            continue
        if not quiet:
            log.info("Mapping parameter %r to %r of the checkpoint", old, new)
        model[new] = model.pop(old)
        if "optim" in state_dict:
            _rename_in_optim(state_dict["optim"], old, new)


def _rename_in_optim(optim: dict[str, Any], old: str, new: str) -> None:
    if "state" in optim:  # nested: {"state": {fqn: ...}, "param_groups": [{"params": [fqn]}]}
        if old in optim["state"]:
            optim["state"][new] = optim["state"].pop(old)
        for group in optim.get("param_groups", []):
            group["params"] = [new if p == old else p for p in group["params"]]
        return
    for key in list(optim):  # flattened: "state.{fqn}.{name}", "param_groups.{fqn}.{name}"
        for part in ("state", "param_groups"):
            if key.startswith(f"{part}.{old}."):
                optim[f"{part}.{new}.{key[len(part) + len(old) + 2 :]}"] = optim.pop(key)
