"""Optimizer configs: parameter groups, overrides, validation, stepping, and state round trips."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn as nn
from testutils import run_distributed_test

from olmolike.config import Config
from olmolike.exceptions import ConfigurationError
from olmolike.optim import (
    AdamWConfig,
    CosWithWarmup,
    OptimConfig,
    OptimGroupOverride,
    SGDConfig,
)

VOCAB, DIM = 16, 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.attention = nn.Linear(DIM, DIM)
        self.mlp = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(torch.relu(self.attention(self.norm(x))))


class TiedLM(nn.Module):
    """An embedding, norms, biases, linear layers and an output head tied to the embedding."""

    def __init__(self, head_first: bool = False) -> None:
        super().__init__()
        if head_first:
            self.head = nn.Linear(DIM, VOCAB, bias=False)
            self.embed = nn.Embedding(VOCAB, DIM)
            self.embed.weight = self.head.weight
        else:
            self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.norm = nn.LayerNorm(DIM)
        if not head_first:
            self.head = nn.Linear(DIM, VOCAB, bias=False)
            self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


MATRICES = [
    "blocks.0.attention.weight",
    "blocks.0.mlp.weight",
    "blocks.1.attention.weight",
    "blocks.1.mlp.weight",
]
NO_DECAY = [
    "embed.weight",
    "blocks.0.norm.weight",
    "blocks.0.norm.bias",
    "blocks.0.attention.bias",
    "blocks.1.norm.weight",
    "blocks.1.norm.bias",
    "blocks.1.attention.bias",
    "norm.weight",
    "norm.bias",
]


def model(seed: int = 0, **kwargs: Any) -> TiedLM:
    torch.manual_seed(seed)
    return TiedLM(**kwargs)


def group_names(net: nn.Module, groups: list[dict[str, Any]]) -> dict[str, list[str]]:
    """Each group's parameters by (first) name, in group order."""
    names = {id(p): name for name, p in net.named_parameters()}
    return {g["name"]: [names[id(p)] for p in g["params"]] for g in groups}


def train_step(net: TiedLM, optim: torch.optim.Optimizer, seed: int) -> None:
    tokens = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(seed))
    loss = nn.functional.cross_entropy(net(tokens).flatten(0, 1), tokens.flatten())
    loss.backward()
    optim.step()
    optim.zero_grad()


def test_only_weight_matrices_decay_and_each_param_appears_once() -> None:
    net = model()
    groups = AdamWConfig(lr=0.01, weight_decay=0.2).param_groups(net)
    assert group_names(net, groups) == {"decay": MATRICES, "no_decay": NO_DECAY}
    assert [(g["weight_decay"], g["lr"], g["initial_lr"]) for g in groups] == [
        (0.2, 0.01, 0.01),
        (0.0, 0.01, 0.01),
    ]
    grouped = [id(p) for g in groups for p in g["params"]]
    assert sorted(grouped) == sorted(id(p) for p in net.parameters())


def test_tied_head_registered_first_is_still_an_embedding() -> None:
    net = model(head_first=True)
    groups = group_names(net, AdamWConfig().param_groups(net))
    assert "head.weight" in groups["no_decay"]
    assert sum(len(names) for names in groups.values()) == len(list(net.parameters()))


def test_decay_flags_move_embeddings_norms_and_biases() -> None:
    net = model()
    embeddings = group_names(net, AdamWConfig(decay_embeddings=True).param_groups(net))
    assert embeddings["decay"] == ["embed.weight", *MATRICES]
    everything = AdamWConfig(decay_embeddings=True, decay_norms_and_biases=True)
    assert [g["name"] for g in everything.param_groups(net)] == ["decay"]


def test_group_layout_does_not_depend_on_values_or_runs() -> None:
    net = model(0)
    first = group_names(net, AdamWConfig(weight_decay=0.0).param_groups(net))
    net = model(1)
    second = group_names(net, AdamWConfig(weight_decay=0.3, lr=1.0).param_groups(net))
    assert list(first) == list(second) == ["decay", "no_decay"]
    assert first == second


def test_frozen_params_are_left_out() -> None:
    net = model()
    net.embed.weight.requires_grad_(False)
    groups = group_names(net, AdamWConfig().param_groups(net))
    assert "embed.weight" not in groups["no_decay"]
    for param in net.parameters():
        param.requires_grad_(False)
    with pytest.raises(ConfigurationError, match="no trainable parameters"):
        AdamWConfig().param_groups(net)


def test_override_with_weight_decay_makes_one_group() -> None:
    net = model()
    override = OptimGroupOverride(params=["blocks.0.*"], opts={"weight_decay": 0.0, "lr": 1e-4})
    groups = AdamWConfig(lr=1e-3, group_overrides=[override]).param_groups(net)
    by_name = {g["name"]: g for g in groups}
    assert list(by_name) == ["decay", "no_decay", "override 0"]
    assert group_names(net, groups)["override 0"] == [
        n for n, _ in net.named_parameters() if n.startswith("blocks.0.")
    ]
    assert by_name["override 0"]["initial_lr"] == by_name["override 0"]["lr"] == 1e-4
    assert by_name["override 0"]["weight_decay"] == 0.0
    assert by_name["decay"]["initial_lr"] == 1e-3


def test_override_without_weight_decay_keeps_the_decay_split() -> None:
    net = model()
    override = OptimGroupOverride(params=["blocks.*"], opts={"lr": 1e-4, "betas": [0.8, 0.9]})
    groups = AdamWConfig(group_overrides=[override]).param_groups(net)
    names = group_names(net, groups)
    assert list(names) == ["no_decay", "override 0 (decay)", "override 0 (no_decay)"]
    assert names["override 0 (decay)"] == MATRICES
    split = {g["name"]: (g["weight_decay"], g.get("betas")) for g in groups}
    assert split["no_decay"] == (0.0, None)
    assert split["override 0 (decay)"] == (0.1, (0.8, 0.9))
    assert split["override 0 (no_decay)"] == (0.0, (0.8, 0.9))


def test_override_values_are_coerced_like_fields() -> None:
    # YAML 1.1 reads ``1e-4`` as a string; the group must still get a float.
    override = OptimGroupOverride(params=["norm.*"], opts={"lr": "1e-4"})
    groups = AdamWConfig(group_overrides=[override]).param_groups(model())
    assert [(g["lr"], g["initial_lr"]) for g in groups if "override" in g["name"]] == [(1e-4, 1e-4)]


def test_override_glob_matches_any_name_of_a_tied_weight() -> None:
    net = model()
    override = OptimGroupOverride(params=["head.weight"], opts={"lr": 0.5})
    names = group_names(net, AdamWConfig(group_overrides=[override]).param_groups(net))
    assert names["override 0 (no_decay)"] == ["embed.weight"]


def test_override_matching_nothing_lists_real_names() -> None:
    override = OptimGroupOverride(params=["blocks.*.atention.*"], opts={"lr": 0.5})
    with pytest.raises(ConfigurationError) as info:
        AdamWConfig(group_overrides=[override]).param_groups(model())
    assert info.value.path == "group_overrides[0].params"
    assert "atention" in str(info.value) and "blocks.0.attention.weight" in str(info.value)


def test_param_matched_by_two_overrides_is_an_error() -> None:
    overrides = [
        OptimGroupOverride(params=["blocks.0.*"], opts={"lr": 0.5}),
        OptimGroupOverride(params=["*.attention.*"], opts={"lr": 0.1}),
    ]
    with pytest.raises(ConfigurationError, match=r"blocks\.0\.attention.*\[0\] and .*\[1\]"):
        AdamWConfig(group_overrides=overrides).param_groups(model())


@pytest.mark.parametrize(
    ("opts", "path", "message"),
    [
        ({"momentum": 0.9}, "group_overrides[0].opts", "lr, betas, eps, weight_decay"),
        ({"lr": -1.0}, "group_overrides[0].opts.lr", "> 0"),
        ({"betas": [0.9, 1.0]}, "group_overrides[0].opts.betas", r"\[0, 1\)"),
        ({"eps": "tiny"}, "group_overrides[0].opts.eps", "number"),
    ],
)
def test_override_options_are_validated_at_config_time(
    opts: dict[str, Any], path: str, message: str
) -> None:
    with pytest.raises(ConfigurationError, match=message) as info:
        AdamWConfig(group_overrides=[OptimGroupOverride(params=["*"], opts=opts)])
    assert info.value.path == path


def test_empty_override_is_rejected() -> None:
    with pytest.raises(ConfigurationError, match="at least one glob"):
        OptimGroupOverride(params=[], opts={"lr": 1.0})
    with pytest.raises(ConfigurationError, match="at least one option"):
        OptimGroupOverride(params=["*"], opts={})


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"lr": 0.0}, "lr"),
        ({"betas": (0.9, 1.0)}, "betas"),
        ({"betas": (-0.1, 0.9)}, "betas"),
        ({"eps": 0.0}, "eps"),
        ({"weight_decay": -0.1}, "weight_decay"),
        ({"fused": True, "foreach": True}, "fused"),
    ],
)
def test_invalid_adamw_configs(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigurationError) as info:
        AdamWConfig(**kwargs)
    assert info.value.path == field


def test_sgd_nesterov_needs_momentum() -> None:
    with pytest.raises(ConfigurationError, match="momentum > 0"):
        SGDConfig(momentum=0.0, nesterov=True)


def test_adamw_decays_only_the_decay_group() -> None:
    net = model()
    optim = AdamWConfig(lr=0.1, weight_decay=0.5).build(net)
    assert isinstance(optim, torch.optim.AdamW)
    before = {name: p.detach().clone() for name, p in net.named_parameters()}
    for param in net.parameters():
        param.grad = torch.zeros_like(param)
    optim.step()
    for name, param in net.named_parameters():
        # A zero gradient makes Adam's update zero: only decoupled weight decay moves a weight.
        expected = before[name] * (1 - 0.1 * 0.5) if name in MATRICES else before[name]
        torch.testing.assert_close(param.detach(), expected, rtol=0, atol=1e-7)


def test_sgd_builds_with_the_same_groups_and_steps() -> None:
    net = model()
    optim = SGDConfig(lr=0.1, weight_decay=0.5, momentum=0.0).build(net)
    assert isinstance(optim, torch.optim.SGD)
    assert [g["name"] for g in optim.param_groups] == ["decay", "no_decay"]
    before = net.blocks[0].attention.weight.detach().clone()
    for param in net.parameters():
        param.grad = torch.zeros_like(param)
    optim.step()
    torch.testing.assert_close(net.blocks[0].attention.weight.detach(), before * 0.95)


def test_fused_is_used_only_where_it_can_run() -> None:
    assert AdamWConfig().build(model()).defaults["fused"] is None
    meta = nn.Linear(2, 2, device="meta")
    with pytest.raises(ConfigurationError, match="fused=null") as info:
        AdamWConfig(fused=True).build(meta)
    assert info.value.path == "fused"


def test_fused_adamw_on_cpu_matches_the_default_kernel() -> None:
    # torch has fused AdamW kernels for CPU too, so fused=True is honoured rather than refused.
    plain, fused = model(), model()
    optims = [AdamWConfig().build(plain), AdamWConfig(fused=True).build(fused)]
    assert optims[1].defaults["fused"] is True
    for step in range(2):
        train_step(plain, optims[0], step)
        train_step(fused, optims[1], step)
    for a, b in zip(plain.parameters(), fused.parameters()):
        torch.testing.assert_close(a, b)


def test_scheduler_scales_every_group_from_its_initial_lr() -> None:
    override = OptimGroupOverride(params=["blocks.*"], opts={"lr": 1e-4})
    optim = AdamWConfig(lr=1e-3, group_overrides=[override]).build(model())
    CosWithWarmup(warmup=10, alpha_f=0.0).set_lr(optim, 5, 100)
    assert {g["name"]: g["lr"] for g in optim.param_groups} == pytest.approx(
        {"no_decay": 5e-4, "override 0 (decay)": 5e-5, "override 0 (no_decay)": 5e-5}
    )


def test_optimizer_state_dict_round_trip() -> None:
    config = AdamWConfig(
        lr=0.01, group_overrides=[OptimGroupOverride(params=["norm.*"], opts={"lr": 0.05})]
    )
    net = model()
    optim = config.build(net)
    for step in range(2):
        train_step(net, optim, step)
    restored_net = copy.deepcopy(net)
    restored = config.build(restored_net)
    restored.load_state_dict(copy.deepcopy(optim.state_dict()))
    strip = [{k: v for k, v in g.items() if k != "params"} for g in optim.param_groups]
    assert [{k: v for k, v in g.items() if k != "params"} for g in restored.param_groups] == strip
    for step in range(2, 4):
        train_step(net, optim, step)
        train_step(restored_net, restored, step)
    for a, b in zip(net.parameters(), restored_net.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@dataclass
class _Parent(Config):
    """A config holding an optimizer the way a train module config does."""

    optim: OptimConfig


def test_config_round_trip_with_overrides() -> None:
    parent = _Parent(
        AdamWConfig(
            lr=3e-4,
            betas=(0.9, 0.99),
            group_overrides=[OptimGroupOverride(params=["embed.*"], opts={"lr": 1e-4})],
        )
    )
    data = parent.as_config_dict()
    assert data["optim"]["_CLASS_"] == "olmolike.optim.config.AdamWConfig"
    assert _Parent.from_dict(data) == parent
    merged = parent.merge(["--optim.lr=1e-3", "--optim.decay_embeddings"])
    assert merged.optim.lr == 1e-3 and merged.optim.decay_embeddings is True
    sgd = _Parent.from_dict({"optim": {"_CLASS_": "SGDConfig", "nesterov": True}})
    assert sgd.optim == SGDConfig(nesterov=True)
    with pytest.raises(ConfigurationError, match="_CLASS_"):
        _Parent.from_dict({"optim": {"lr": 1e-3}})


def _sharded_groups() -> dict[str, Any]:
    """On each rank: FSDP2 and DDP models group like the plain model, and FSDP2 steps."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from torch.nn.parallel import DistributedDataParallel

    config = AdamWConfig(group_overrides=[OptimGroupOverride(params=["norm.*"], opts={"lr": 0.5})])
    plain = model()
    expected = group_names(plain, config.param_groups(plain))
    ddp = DistributedDataParallel(model())
    assert group_names(ddp.module, config.param_groups(ddp)) == expected

    net = model()
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    for block in net.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(net, mesh=mesh)
    optim = config.build(net)
    assert all(isinstance(p, DTensor) for g in optim.param_groups for p in g["params"])
    assert group_names(net, optim.param_groups) == expected
    train_step(net, optim, seed=0)
    return {
        "groups": [(g["name"], g["initial_lr"], len(g["params"])) for g in optim.param_groups],
        "head": net.head.weight.full_tensor(),
    }


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_fsdp2_params_group_and_step_identically_on_two_ranks() -> None:
    results = run_distributed_test(_sharded_groups, world_size=2)
    assert results[0]["groups"] == results[1]["groups"]
    assert [name for name, _, _ in results[0]["groups"]] == [
        "decay",
        "no_decay",
        "override 0 (no_decay)",
    ]
    torch.testing.assert_close(results[0]["head"], results[1]["head"])
    assert not torch.equal(results[0]["head"], model().head.weight.detach())
