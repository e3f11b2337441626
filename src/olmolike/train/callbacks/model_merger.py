"""OLMo-core's module path for the model-merging callback and its schedule helpers.

``olmo_core.train.callbacks.model_merger`` is where OLMo-core scripts import
``compute_merge_window_starts`` and ``compute_merge_steps_from_decay_schedule`` from; the
code lives in :mod:`.model_merge`, and these are the same objects.
"""

from .model_merge import (
    ModelMergeCallback,
    compute_merge_steps_from_decay_schedule,
    compute_merge_window_starts,
)

__all__ = [
    "ModelMergeCallback",
    "compute_merge_steps_from_decay_schedule",
    "compute_merge_window_starts",
]
