"""The experts of an ``OlmoeForCausalLM`` checkpoint in Hugging Face's layout and ours.

Hugging Face stores expert ``j`` of layer ``i`` as three ``nn.Linear`` weights
(``model.layers.i.mlp.experts.j.{gate,up,down}_proj.weight``, ``(out, in)``), which is what
``save_pretrained`` writes and every OLMoE on the Hub holds; transformers 5 fuses them in
memory (``mlp.experts.gate_up_proj`` ``(E, 2h, d)``, gate rows first, and
``mlp.experts.down_proj`` ``(E, d, h)``), and a folder may hold that form too. Ours stacks
each projection over the experts, ``(in, out)``: ``experts.w_gate``/``w_up`` ``(E, d, h)``,
``experts.w_down`` ``(E, h, d)``. Converting transposes each expert's matrix; no value changes.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

__all__ = ["expert_tensors_from_hf", "expert_tensors_to_hf"]

_PROJECTIONS = {"w_gate": "gate_proj", "w_up": "up_proj", "w_down": "down_proj"}


def expert_tensors_to_hf(
    state: Mapping[str, Tensor], moe_layers: list[int], num_experts: int
) -> dict[str, Tensor]:
    """Hugging Face's per-expert tensors of every MoE layer of ``state`` (ours)."""
    out: dict[str, Tensor] = {}
    for i in moe_layers:
        for ours, theirs in _PROJECTIONS.items():
            stacked = state[f"blocks.{i}.feed_forward.experts.{ours}"].detach()
            for j in range(num_experts):
                name = f"model.layers.{i}.mlp.experts.{j}.{theirs}.weight"
                out[name] = stacked[j].t().contiguous()
    return out


def expert_tensors_from_hf(
    hf: Mapping[str, Tensor], moe_layers: list[int], num_experts: int
) -> tuple[dict[str, Tensor], set[str], list[str]]:
    """Our stacked expert tensors from ``hf`` (per-expert or fused form, per layer), the
    Hugging Face names they used, and the names missing for a layer found in neither form."""
    ours: dict[str, Tensor] = {}
    used: set[str] = set()
    missing: list[str] = []
    for i in moe_layers:
        prefix = f"model.layers.{i}.mlp.experts"
        fused = (f"{prefix}.gate_up_proj", f"{prefix}.down_proj")
        if all(name in hf for name in fused):
            gate_up, down = hf[fused[0]], hf[fused[1]]
            if gate_up.dim() != 3 or gate_up.shape[1] % 2:
                missing.append(f"{fused[0]} (shape {tuple(gate_up.shape)} is not (E, 2h, d))")
                continue
            gate, up = gate_up.chunk(2, dim=1)
            stacked = {"w_gate": gate, "w_up": up, "w_down": down}
            used.update(fused)
            for name, tensor in stacked.items():
                ours[f"blocks.{i}.feed_forward.experts.{name}"] = tensor.transpose(1, 2)
            continue
        for name, theirs in _PROJECTIONS.items():
            keys = [f"{prefix}.{j}.{theirs}.weight" for j in range(num_experts)]
            absent = [k for k in keys if k not in hf]
            if absent:
                missing.extend(absent)
                continue
            used.update(keys)
            ours[f"blocks.{i}.feed_forward.experts.{name}"] = torch.stack([hf[k].t() for k in keys])
    return ours, used, missing
