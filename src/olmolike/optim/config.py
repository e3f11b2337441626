"""Optimizer configs: which parameters decay, per-group overrides, and ``build(model)``.

Parameters are split into a few groups by what they are, not by their names, so the same
config works for any model: a weight matrix decays; a norm weight or a bias (``ndim < 2``) and
an embedding table do not, unless asked. Grouping by module type and ``ndim`` also works on
FSDP2 models, whose parameters stay ``nn.Parameter`` DTensors with their original ``ndim``.

The group layout is part of every optimizer checkpoint, so it must be identical on every rank
and in every run: groups come in a fixed order (``decay``, ``no_decay``, then the overrides in
config order), parameters within a group keep ``model.named_parameters()`` order, and the
layout does not depend on hyperparameter values (``weight_decay=0`` still yields both groups).
"""

from __future__ import annotations

import abc
import fnmatch
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim.optimizer import _device_dtype_check_for_fused

from ..config import Config, register_config_class, require_class_name
from ..exceptions import ConfigurationError

__all__ = ["AdamWConfig", "OptimConfig", "OptimGroupOverride", "SGDConfig"]

log = logging.getLogger(__name__)

_EMBEDDING_TYPES = (nn.Embedding, nn.EmbeddingBag)
_NAMES_SHOWN_IN_ERRORS = 8


@dataclass
class OptimGroupOverride(Config):
    """Different optimizer options for the parameters whose names match ``params``.

    The options apply on top of the automatic grouping: an override that only changes ``lr``
    still leaves norms and biases without weight decay.
    """

    params: list[str]
    """``fnmatch`` globs on parameter names, e.g. ``["blocks.*.attention.*"]``."""

    opts: dict[str, Any]
    """Optimizer options for the matched parameters, e.g. ``{"weight_decay": 0.0, "lr": 1e-4}``."""

    def validate(self) -> None:
        if not self.params:
            raise self._invalid("params", "give at least one glob, e.g. ['blocks.0.*']")
        if any(not glob for glob in self.params):
            raise self._invalid("params", "globs must be non-empty strings")
        if not self.opts:
            raise self._invalid("opts", "give at least one option, e.g. {weight_decay: 0.0}")


@dataclass
class _TrainableParam:
    """A trainable parameter under every name it has (a tied weight has several)."""

    names: list[str]
    param: nn.Parameter


@dataclass
class OptimConfig(Config, abc.ABC):
    """Base class for optimizer configs: the grouping rules shared by every optimizer.

    A subclass lists its per-group options in ``group_options`` and implements :meth:`build`.
    """

    lr: float
    """The learning rate; schedulers scale each group's ``initial_lr`` (this, or an override's)."""

    group_overrides: list[OptimGroupOverride] | None = None
    """Options for parameters matched by name; a parameter may match at most one override."""

    weight_decay: float = 0.0
    """Weight decay for the parameters that decay (see the two flags below)."""

    decay_norms_and_biases: bool = False
    """Decay parameters with ``ndim < 2`` (norm weights, biases) too."""

    decay_embeddings: bool = False
    """Decay ``nn.Embedding`` weights too (tied output heads count as embeddings)."""

    fused: bool | None = None
    """Use the fused kernel. ``None``: fused when every parameter is on CUDA."""

    foreach: bool | None = None
    """Use the multi-tensor (foreach) implementation; ``None`` lets torch choose."""

    group_options: ClassVar[tuple[str, ...]] = ("lr", "weight_decay")
    """Fields that an override's ``opts`` may set for its groups."""

    def validate(self) -> None:
        if not self.lr > 0:
            raise self._invalid("lr", f"must be > 0, got {self.lr}")
        if not self.weight_decay >= 0:
            raise self._invalid("weight_decay", f"must be >= 0, got {self.weight_decay}")
        if self.fused and self.foreach:
            raise self._invalid("fused", "fused and foreach cannot both be true; set one to null")
        for index in range(len(self.group_overrides or ())):
            self._override_options(index)

    @abc.abstractmethod
    def build(self, model: nn.Module) -> torch.optim.Optimizer:
        """Build the optimizer over ``model``'s trainable parameters, grouped by :meth:`param_groups`."""

    def param_groups(self, model: nn.Module) -> list[dict[str, Any]]:
        """The parameter groups for ``model``, each with ``name``, ``lr`` and ``initial_lr``.

        Frozen parameters (``requires_grad=False``) are left out. Empty groups are dropped.
        """
        self.validate()
        model = _unwrap(model)
        params = _trainable_params(model)
        if not params:
            raise ConfigurationError(
                f"{type(model).__name__} has no trainable parameters; unfreeze some "
                "(requires_grad=True) before building the optimizer"
            )
        embeddings = _embedding_param_ids(model)
        owners = self._match_overrides(params)
        groups = self._empty_groups()
        for item in params:
            kind = "decay" if self._decays(item.param, id(item.param) in embeddings) else "no_decay"
            owner = owners.get(id(item.param))
            key = kind if owner is None else f"override {owner}"
            if key not in groups:
                key = f"{key} ({kind})"
            groups[key]["params"].append(item.param)
        result = [group for group in groups.values() if group["params"]]
        log.debug("parameter groups: %s", {g["name"]: len(g["params"]) for g in result})
        return result

    def _empty_groups(self) -> dict[str, dict[str, Any]]:
        """Every group this config can produce, in their fixed order."""
        groups = {
            "decay": self._new_group("decay", True, {}),
            "no_decay": self._new_group("no_decay", False, {}),
        }
        for index in range(len(self.group_overrides or ())):
            opts = self._override_options(index)
            if "weight_decay" in opts:
                groups[f"override {index}"] = self._new_group(f"override {index}", True, opts)
            else:
                for kind, decays in (("decay", True), ("no_decay", False)):
                    name = f"override {index} ({kind})"
                    groups[name] = self._new_group(name, decays, opts)
        return groups

    def _decays(self, param: nn.Parameter, is_embedding: bool) -> bool:
        if is_embedding:
            return self.decay_embeddings
        return param.ndim >= 2 or self.decay_norms_and_biases

    def _new_group(self, name: str, decays: bool, opts: dict[str, Any]) -> dict[str, Any]:
        lr = opts.get("lr", self.lr)
        weight_decay = self.weight_decay if decays else 0.0
        return {
            "name": name,
            "params": [],
            "weight_decay": weight_decay,
            **opts,
            "lr": lr,
            "initial_lr": lr,
        }

    def _override_options(self, index: int) -> dict[str, Any]:
        """Override ``index``'s options, type-checked and validated like this config's fields."""
        assert self.group_overrides is not None
        opts = self.group_overrides[index].opts
        path = f"group_overrides[{index}].opts"
        unknown = sorted(set(opts) - set(self.group_options))
        if unknown:
            raise ConfigurationError(
                f"{type(self).__name__} groups have no option {', '.join(map(repr, unknown))}; "
                f"an override can set: {', '.join(self.group_options)}",
                path=path,
            )
        # Rebuilding this config with the override's values applies the same type coercion
        # (e.g. a YAML list for betas) and the same range checks as the top-level fields.
        data = {**self.as_dict(recurse=False), "group_overrides": None, **opts}
        try:
            rebuilt = type(self).from_dict(data)
        except ConfigurationError as e:
            raise e.under(path) from None
        return {key: getattr(rebuilt, key) for key in opts}

    def _match_overrides(self, params: list[_TrainableParam]) -> dict[int, int]:
        """Map each overridden parameter's id to the index of the one override that matches it."""
        owners: dict[int, int] = {}
        for index, override in enumerate(self.group_overrides or ()):
            for glob in override.params:
                matched = [p for p in params if _matches(p.names, glob)]
                if not matched:
                    raise ConfigurationError(
                        f"{glob!r} matches no trainable parameter; names look like: "
                        f"{_some_names(params)}",
                        path=f"group_overrides[{index}].params",
                    )
                for item in matched:
                    previous = owners.setdefault(id(item.param), index)
                    if previous != index:
                        raise ConfigurationError(
                            f"parameter {item.names[0]!r} is matched by group_overrides"
                            f"[{previous}] and group_overrides[{index}]; make the globs disjoint",
                            path=f"group_overrides[{index}].params",
                        )
        return owners

    def _resolve_fused(self, groups: Iterable[dict[str, Any]]) -> bool | None:
        """``fused`` for torch: checked against the parameters now rather than at the first step."""
        params = [p for group in groups for p in group["params"]]
        if self.fused:
            for param in params:
                try:
                    _device_dtype_check_for_fused(param)
                except RuntimeError as e:
                    raise ConfigurationError(
                        f"fused=True but a parameter cannot use the fused kernel ({e}); set "
                        "fused=null to pick an implementation automatically",
                        path="fused",
                    ) from None
            return True
        if self.fused is None and not self.foreach:
            return all(p.device.type == "cuda" for p in params) or None
        return self.fused


def _unwrap(model: nn.Module) -> nn.Module:
    """The module inside a DDP wrapper, so that names (and override globs) are the model's own."""
    while isinstance(model, DistributedDataParallel):
        model = model.module
    return model


def _embedding_param_ids(model: nn.Module) -> set[int]:
    return {
        id(param)
        for module in model.modules()
        if isinstance(module, _EMBEDDING_TYPES)
        for param in module.parameters(recurse=False)
    }


def _trainable_params(model: nn.Module) -> list[_TrainableParam]:
    by_id: dict[int, _TrainableParam] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if not param.requires_grad:
            continue
        if id(param) in by_id:
            by_id[id(param)].names.append(name)
        else:
            by_id[id(param)] = _TrainableParam([name], param)
    return list(by_id.values())


def _matches(names: list[str], glob: str) -> bool:
    return any(fnmatch.fnmatchcase(name, glob) for name in names)


def _some_names(params: list[_TrainableParam]) -> str:
    names = [item.names[0] for item in params]
    shown = ", ".join(names[:_NAMES_SHOWN_IN_ERRORS])
    more = len(names) - _NAMES_SHOWN_IN_ERRORS
    return f"{shown}, ... ({more} more)" if more > 0 else shown


@dataclass
class AdamWConfig(OptimConfig):
    """:class:`torch.optim.AdamW` with decoupled weight decay on weight matrices only."""

    lr: float = 1e-3
    """The peak learning rate (a scheduler scales it per step)."""
    weight_decay: float = 0.1
    """Decoupled weight decay (AdamW's: each step shrinks the weights by ``lr * weight_decay`` of
    themselves) on the parameters that decay: weight matrices, and embeddings, norms and biases only
    as ``decay_embeddings`` and ``decay_norms_and_biases`` say."""
    betas: tuple[float, float] = (0.9, 0.95)
    """The decay rates of the running means of the gradient and of its square."""
    eps: float = 1e-8
    """Added to the square root of the second moment, for numerical safety."""

    group_options: ClassVar[tuple[str, ...]] = ("lr", "betas", "eps", "weight_decay")

    def validate(self) -> None:
        super().validate()
        if not all(0 <= beta < 1 for beta in self.betas):
            raise self._invalid("betas", f"each must be in [0, 1), got {tuple(self.betas)}")
        if not self.eps > 0:
            raise self._invalid("eps", f"must be > 0, got {self.eps}")

    def build(self, model: nn.Module) -> torch.optim.AdamW:
        groups = self.param_groups(model)
        return torch.optim.AdamW(
            groups,
            lr=self.lr,
            betas=(self.betas[0], self.betas[1]),
            eps=self.eps,
            weight_decay=self.weight_decay,
            fused=self._resolve_fused(groups),
            foreach=self.foreach,
        )


@dataclass
class SGDConfig(OptimConfig):
    """:class:`torch.optim.SGD` with the same grouping rules as :class:`AdamWConfig`."""

    lr: float = 1e-2
    """The peak learning rate (a scheduler scales it per step)."""
    momentum: float = 0.9
    """The momentum factor (0: plain SGD)."""
    dampening: float = 0.0
    """How much of each new gradient is left out of the momentum (0: none)."""
    nesterov: bool = False
    """Use Nesterov momentum (needs momentum > 0 and dampening 0)."""

    group_options: ClassVar[tuple[str, ...]] = (
        "lr",
        "momentum",
        "dampening",
        "nesterov",
        "weight_decay",
    )

    def validate(self) -> None:
        super().validate()
        if not self.momentum >= 0:
            raise self._invalid("momentum", f"must be >= 0, got {self.momentum}")
        if self.nesterov and (self.momentum == 0 or self.dampening != 0):
            raise self._invalid(
                "nesterov", "needs momentum > 0 and dampening = 0; change those or set it false"
            )

    def build(self, model: nn.Module) -> torch.optim.SGD:
        groups = self.param_groups(model)
        return torch.optim.SGD(
            groups,
            lr=self.lr,
            momentum=self.momentum,
            dampening=self.dampening,
            nesterov=self.nesterov,
            weight_decay=self.weight_decay,
            fused=self._resolve_fused(groups),
            foreach=self.foreach,
        )


# Short names for ``_CLASS_`` in config files and overrides (``--optim._CLASS_=SGDConfig``).
register_config_class(AdamWConfig, "AdamWConfig")
register_config_class(SGDConfig, "SGDConfig")
require_class_name(OptimConfig)
