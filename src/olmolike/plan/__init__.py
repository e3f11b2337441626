"""The memory planner behind ``olmolike plan``: how many bytes each rank of a layout holds,
and which layouts fit a cluster.

It reads a run's configs (the model, the layout of the train module, the optimizer) and never
runs the trainer: it sits above :mod:`olmolike.train` (whose train-module configs it reads) and
below the command line, the only part of the library that imports it.

* :mod:`.memory`: parameters, gradients, buffers and optimizer state, tensor by tensor, per
  rank of a :class:`~olmolike.plan.memory.Layout`;
* :mod:`.activations`: the activations one rank keeps for backward;
* :mod:`.report`: ``olmolike plan``'s report and the layouts that fit.
"""

from .activations import ActivationBytes, activation_bytes, microbatches_in_flight
from .memory import Layout, StateBytes, layouts, state_bytes
from .report import RankMemory, config_layout, plan_report, rank_memory

__all__ = [
    "ActivationBytes",
    "Layout",
    "RankMemory",
    "StateBytes",
    "activation_bytes",
    "config_layout",
    "layouts",
    "microbatches_in_flight",
    "plan_report",
    "rank_memory",
    "state_bytes",
]
