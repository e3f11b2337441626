"""The shape of a :class:`~olmolike.nn.transformer.Transformer`: its config, the named presets
(OLMo-2, Llama and OLMoE sizes), the parameter and FLOP counts derived from a shape (total and,
for mixtures of experts, active), and :meth:`TransformerConfig.build`.

The model itself is in :mod:`olmolike.nn.transformer`; this module imports it to build one, and
the model refers to its config for types only, so each reads without the other.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, fields
from typing import Any

import torch

from ..config import Config, StrEnum, register_config_class
from ..exceptions import ConfigurationError
from .moe import MoEConfig
from .rope import RopeScalingConfig
from .transformer import Transformer, TransformerBlockType

__all__ = ["TransformerConfig", "TransformerPreset", "computation_changes", "model_override"]

log = logging.getLogger(__name__)


class TransformerPreset(StrEnum):
    """Named model shapes; ``TransformerConfig.from_preset(name, vocab_size)`` builds one."""

    tiny = "tiny"
    small = "small"
    olmo2_30M = "olmo2_30M"
    olmo2_190M = "olmo2_190M"
    olmo2_1B = "olmo2_1B"
    olmo2_7B = "olmo2_7B"
    llama2_7B = "llama2_7B"
    llama3_8B = "llama3_8B"
    moe_tiny = "moe_tiny"
    moe_small = "moe_small"
    olmoe_1B_7B = "olmoe_1B_7B"


# The mid-size OLMo-2 names count non-embedding parameters, so they hold for any vocabulary.
_PRESETS: dict[TransformerPreset, dict[str, Any]] = {
    TransformerPreset.tiny: dict(d_model=128, n_layers=4, n_heads=4),
    TransformerPreset.small: dict(d_model=256, n_layers=6, n_heads=4),
    TransformerPreset.olmo2_30M: dict(
        d_model=512, n_layers=8, n_heads=8, mlp_hidden_size=1792, qk_norm=True,
        block_type=TransformerBlockType.reordered_norm,
    ),
    TransformerPreset.olmo2_190M: dict(
        d_model=1024, n_layers=14, n_heads=16, mlp_hidden_size=3072, qk_norm=True,
        block_type=TransformerBlockType.reordered_norm,
    ),
    TransformerPreset.olmo2_1B: dict(
        d_model=2048, n_layers=16, n_heads=16, mlp_hidden_size=8192, qk_norm=True,
        block_type=TransformerBlockType.reordered_norm,
    ),
    TransformerPreset.olmo2_7B: dict(
        d_model=4096, n_layers=32, n_heads=32, mlp_hidden_size=11008, qk_norm=True,
        block_type=TransformerBlockType.reordered_norm,
    ),
    TransformerPreset.llama2_7B: dict(
        d_model=4096, n_layers=32, n_heads=32, mlp_hidden_size=11008, rope_theta=10_000.0,
        norm_eps=1e-5,
    ),
    TransformerPreset.llama3_8B: dict(
        d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, mlp_hidden_size=14336,
        max_sequence_length=8192, norm_eps=1e-5,
    ),
    # OLMoE's blocks (pre-norm, QK-norm) at the sizes of `tiny` and `small`, whose dense MLP
    # width top-2 of 8 experts matches in active parameters (moe_tiny) or exceeds by half.
    TransformerPreset.moe_tiny: dict(
        d_model=128, n_layers=4, n_heads=4, qk_norm=True,
        moe=MoEConfig(num_experts=8, top_k=2, hidden_size=256),
    ),
    TransformerPreset.moe_small: dict(
        d_model=256, n_layers=6, n_heads=4, qk_norm=True,
        moe=MoEConfig(num_experts=8, top_k=2, hidden_size=384),
    ),
    # allenai/OLMoE-1B-7B-0924: 6.92 B parameters, 1.28 B active, with its vocabulary of
    # 50,304. Its experts are 1024 wide (transformers' OlmoeConfig defaults to 2048, which
    # would make 13.4 B); pre-norm blocks with QK-norm over all heads.
    TransformerPreset.olmoe_1B_7B: dict(
        d_model=2048, n_layers=16, n_heads=16, mlp_hidden_size=1024, qk_norm=True,
        rope_theta=10_000.0, norm_eps=1e-5,
        moe=MoEConfig(
            num_experts=64, top_k=8, hidden_size=1024, load_balancing_loss_coefficient=0.01,
            router_z_loss_coefficient=0.001,
        ),
    ),
}  # fmt: skip


@dataclass
class TransformerConfig(Config):
    """The shape of a :class:`Transformer`; :meth:`build` makes one.

    ``n_kv_heads`` below ``n_heads`` turns on grouped-query attention; ``qk_norm`` adds
    RMSNorm on the query and key projections (over all heads at once, as OLMo-2 does);
    ``tie_weights`` shares the embedding matrix with the output head; ``block_type`` places
    the norms (:class:`TransformerBlockType`). The ``olmo2_*`` presets are OLMo-2 blocks
    (reordered norm and QK-norm), the others Llama blocks. ``rope_scaling`` stretches RoPE to
    a longer context as Llama 3.1 does (:class:`~olmolike.nn.rope.RopeScalingConfig`).
    """

    vocab_size: int
    """Rows of the embedding and of the output head: at least the tokenizer's vocabulary (often
    rounded up to a multiple of 128, which keeps the matmuls fast). Every token id must be below it.
    """
    d_model: int
    """The width of the residual stream: the size of each token's hidden vector, and of the
    embeddings."""
    n_layers: int
    """Transformer blocks, each attention then MLP."""
    n_heads: int
    """Attention (query) heads per block; must divide ``d_model``, and each head's width ``d_model /
    n_heads`` must be even (rotary embeddings rotate pairs)."""
    n_kv_heads: int | None = None
    """Key/value heads per block, a divisor of ``n_heads``: fewer than ``n_heads`` is grouped-query
    attention (a smaller KV cache and fewer parameters). ``None``: as many as ``n_heads``."""
    mlp_hidden_size: int | None = None
    """The inner width of each SwiGLU MLP. ``None``: 8/3 of ``d_model`` rounded up to
    ``mlp_multiple_of`` (the parameters of a 4x GELU MLP)."""
    mlp_multiple_of: int = 256
    """With ``mlp_hidden_size`` unset, the MLP width is rounded up to a multiple of this."""
    max_sequence_length: int = 4096
    """The longest input in tokens: the rotary tables are built this long. It changes no weight:
    raise it to take longer sequences (the data's ``sequence_length`` must not exceed it)."""
    rope_theta: float = 500_000.0
    """The base of the rotary position embeddings' frequencies: larger bases rotate slower, for
    longer contexts (Llama 2: 10,000; Llama 3 and OLMo-2: 500,000)."""
    rope_scaling: RopeScalingConfig | None = None
    """Llama 3.1's stretch of the rotary frequencies to a longer context
    (:class:`~olmolike.nn.rope.RopeScalingConfig`); ``None``: none."""
    norm_eps: float = 1e-6
    """The epsilon added to the mean square in every RMSNorm, for numerical safety."""
    qk_norm: bool = False
    """Apply RMSNorm to the query and key projections (over all heads at once, as OLMo-2 does),
    which keeps attention logits from growing."""
    tie_weights: bool = False
    """Share the embedding matrix with the output head (one ``vocab_size x d_model`` matrix instead
    of two)."""
    block_type: TransformerBlockType = TransformerBlockType.default
    """Where each block normalizes (:class:`~olmolike.nn.TransformerBlockType`): ``default`` before
    attention and MLP (Llama), ``reordered_norm`` on their outputs (OLMo-2)."""
    init_std: float = 0.02
    """The standard deviation of the initial weights (truncated normal at 3 std; output projections
    scaled down with depth). Only a fresh model uses it."""
    moe: MoEConfig | None = None
    """Mixture-of-experts feed-forwards (:class:`~olmolike.nn.moe.MoEConfig`: experts, top-k,
    which layers, the auxiliary losses' coefficients); ``None``: every MLP is dense."""

    def validate(self) -> None:
        positive_ints = ("vocab_size", "d_model", "n_layers", "n_heads", "mlp_multiple_of")
        for name in (*positive_ints, "max_sequence_length"):
            if getattr(self, name) < 1:
                raise self._invalid(name, f"must be a positive integer, got {getattr(self, name)}")
        for name in ("rope_theta", "norm_eps", "init_std"):
            if not getattr(self, name) > 0:
                raise self._invalid(name, f"must be > 0, got {getattr(self, name)}")
        if self.d_model % self.n_heads:
            raise self._invalid(
                "n_heads", f"must divide d_model={self.d_model}, got {self.n_heads}; pick a divisor"
            )
        if self.head_dim % 2:
            raise self._invalid(
                "n_heads",
                f"gives an odd head_dim {self.head_dim} (d_model / n_heads), but rotary "
                "embeddings rotate pairs of features; choose n_heads so that head_dim is even",
            )
        if self.n_kv_heads is not None and (self.n_kv_heads < 1 or self.n_heads % self.n_kv_heads):
            raise self._invalid(
                "n_kv_heads",
                f"must be a positive divisor of n_heads={self.n_heads}, got {self.n_kv_heads} "
                "(or null for no grouped-query attention)",
            )
        if self.mlp_hidden_size is not None and self.mlp_hidden_size < 1:
            raise self._invalid("mlp_hidden_size", f"must be positive, got {self.mlp_hidden_size}")
        if self.moe is not None:
            try:
                self.moe.check_layers(self.n_layers)
            except ConfigurationError as e:
                raise e.under("moe") from None

    # -- presets ---------------------------------------------------------------------------

    @classmethod
    def from_preset(cls, name: str, vocab_size: int, **overrides: Any) -> TransformerConfig:
        """The preset called ``name`` (a :class:`TransformerPreset`), with fields overridden."""
        try:
            preset = TransformerPreset(name)
        except ValueError:
            valid = ", ".join(p.value for p in TransformerPreset)
            raise ConfigurationError(
                f"unknown model preset {name!r}; choose one of: {valid}"
            ) from None
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ConfigurationError(
                f"unknown TransformerConfig field(s) {', '.join(unknown)} in overrides of preset "
                f"{name!r}; valid fields are: {', '.join(sorted(known))}"
            )
        # A copy: a preset's MoEConfig must not be shared by (and changed through) its configs.
        shape = copy.deepcopy(_PRESETS[preset])
        return cls(**{**shape, "vocab_size": vocab_size, **overrides})

    @classmethod
    def tiny(cls, vocab_size: int, **overrides: Any) -> TransformerConfig:
        """About 1 M parameters with a byte-level vocabulary: the size CI trains."""
        return cls.from_preset(TransformerPreset.tiny, vocab_size, **overrides)

    @classmethod
    def small(cls, vocab_size: int, **overrides: Any) -> TransformerConfig:
        """About 5 M parameters: learns visibly within minutes on a laptop CPU."""
        return cls.from_preset(TransformerPreset.small, vocab_size, **overrides)

    @classmethod
    def olmo2_30M(cls, vocab_size: int, **overrides: Any) -> TransformerConfig:
        return cls.from_preset(TransformerPreset.olmo2_30M, vocab_size, **overrides)

    @classmethod
    def olmo2_190M(cls, vocab_size: int, **overrides: Any) -> TransformerConfig:
        return cls.from_preset(TransformerPreset.olmo2_190M, vocab_size, **overrides)

    @classmethod
    def olmo2_1B(cls, vocab_size: int, **overrides: Any) -> TransformerConfig:
        """The shape of OLMo-2-0425-1B (1.48 B parameters with its vocabulary of 100,352)."""
        return cls.from_preset(TransformerPreset.olmo2_1B, vocab_size, **overrides)

    @classmethod
    def olmo2_7B(cls, vocab_size: int, **overrides: Any) -> TransformerConfig:
        """The shape of OLMo-2-1124-7B (7.30 B parameters with its vocabulary of 100,352)."""
        return cls.from_preset(TransformerPreset.olmo2_7B, vocab_size, **overrides)

    @classmethod
    def llama2_7B(cls, vocab_size: int, **overrides: Any) -> TransformerConfig:
        """The shape of Llama-2-7B (6.74 B parameters with its vocabulary of 32,000)."""
        return cls.from_preset(TransformerPreset.llama2_7B, vocab_size, **overrides)

    @classmethod
    def llama3_8B(cls, vocab_size: int, **overrides: Any) -> TransformerConfig:
        """The shape of Llama-3-8B (8.03 B parameters with its vocabulary of 128,256)."""
        return cls.from_preset(TransformerPreset.llama3_8B, vocab_size, **overrides)

    @classmethod
    def moe_tiny(cls, vocab_size: int, **overrides: Any) -> TransformerConfig:
        """:meth:`tiny`'s size with OLMoE's blocks, top-2 of 8 experts as wide as half tiny's
        MLP (3.5 M parameters, 1.1 M active with a byte-level vocabulary): the CPU demo's."""
        return cls.from_preset(TransformerPreset.moe_tiny, vocab_size, **overrides)

    @classmethod
    def moe_small(cls, vocab_size: int, **overrides: Any) -> TransformerConfig:
        """:meth:`small`'s size with OLMoE's blocks and top-2 of 8 experts."""
        return cls.from_preset(TransformerPreset.moe_small, vocab_size, **overrides)

    @classmethod
    def olmoe_1B_7B(cls, vocab_size: int, **overrides: Any) -> TransformerConfig:
        """The shape of OLMoE-1B-7B: 64 experts, top-8 (6.92 B parameters, 1.28 B active, with
        its vocabulary of 50,304)."""
        return cls.from_preset(TransformerPreset.olmoe_1B_7B, vocab_size, **overrides)

    # -- derived sizes ---------------------------------------------------------------------

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def hidden_size(self) -> int:
        """The SwiGLU width: 8/3 of ``d_model`` (same parameters as a 4x GELU MLP), rounded up."""
        if self.mlp_hidden_size is not None:
            return self.mlp_hidden_size
        return -(-8 * self.d_model // (3 * self.mlp_multiple_of)) * self.mlp_multiple_of

    @property
    def expert_hidden_size(self) -> int:
        """Each routed expert's SwiGLU width (``moe.hidden_size``, else :attr:`hidden_size`)."""
        if self.moe is not None and self.moe.hidden_size is not None:
            return self.moe.hidden_size
        return self.hidden_size

    @property
    def has_shared_expert(self) -> bool:
        return self.moe is not None and self.moe.shared_expert_hidden_size is not None

    def is_moe_layer(self, index: int) -> bool:
        """Whether layer ``index``'s feed-forward is a mixture of experts."""
        return self.moe is not None and self.moe.is_moe_layer(index)

    def _block_params(self, index: int, *, active: bool = False) -> int:
        """Layer ``index``'s parameters; ``active``: those one token's forward uses (its
        ``top_k`` experts of all)."""
        d, kv_dim = self.d_model, self.kv_heads * self.head_dim
        attention = 2 * d * d + 2 * d * kv_dim + ((d + kv_dim) if self.qk_norm else 0)
        if not self.is_moe_layer(index):
            return attention + 3 * d * self.hidden_size + 2 * d
        assert self.moe is not None
        experts = self.moe.top_k if active else self.moe.num_experts
        shared = self.moe.shared_expert_hidden_size or 0
        router = self.moe.num_experts * d
        mlp = router + 3 * d * (experts * self.expert_hidden_size + shared)
        return attention + mlp + 2 * d

    def _blocks_params(self, *, active: bool = False) -> int:
        return sum(self._block_params(i, active=active) for i in range(self.n_layers))

    def num_params(self) -> int:
        """Every parameter (every expert), a tied embedding counted once."""
        embeddings = self.vocab_size * self.d_model * (1 if self.tie_weights else 2)
        return embeddings + self._blocks_params() + self.d_model

    def num_active_params(self) -> int:
        """The parameters one token's forward uses: :meth:`num_params` with each MoE layer's
        ``top_k`` experts instead of all (the same as :meth:`num_params` for a dense model)."""
        embeddings = self.vocab_size * self.d_model * (1 if self.tie_weights else 2)
        return embeddings + self._blocks_params(active=True) + self.d_model

    def num_non_embedding_params(self) -> int:
        """Parameters outside the embedding and the output head (the usual scaling-law N)."""
        return self._blocks_params() + self.d_model

    def num_active_non_embedding_params(self) -> int:
        """:meth:`num_non_embedding_params` with each MoE layer's ``top_k`` experts only."""
        return self._blocks_params(active=True) + self.d_model

    def num_flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs (forward + backward) per token for sequences of ``seq_len`` tokens.

        ``6 * N`` for the weights, where N is :meth:`num_active_non_embedding_params` (a
        token's ``top_k`` experts, not all of them, and the router) plus the output head (its
        matmul runs even when its weight is tied; the embedding lookup is no matmul), plus
        ``12 * n_layers * d_model * seq_len`` for the attention scores and the weighted sum
        of values. That attention term counts the full score matrix, as PaLM's MFU does: a
        causal kernel skips about half of it, so this overstates the work done by that much.
        """
        weights = self.num_active_non_embedding_params() + self.vocab_size * self.d_model
        return 6 * weights + 12 * self.n_layers * self.d_model * seq_len

    def build(
        self, *, init_device: str | torch.device = "cpu", seed: int | None = None
    ) -> Transformer:
        """Build the model; ``init_device="meta"`` allocates nothing (materialise it later)."""
        self.validate()
        with torch.device("meta"):
            model = Transformer(self)
        if torch.device(init_device).type != "meta":
            model.materialize(init_device, seed=seed)
        active = ""
        if self.moe is not None:
            active = f", {self.num_active_params():,} active per token"
        log.info(
            "built a transformer with %s parameters (%s non-embedding%s) on %s",
            f"{self.num_params():,}", f"{self.num_non_embedding_params():,}", active, init_device,
        )  # fmt: skip
        return model


# Fields that change nothing trained weights compute: how fresh weights are drawn, and the
# longest input accepted (positions below both lengths get the same rotary angles, and the
# data's sequence length is checked against it). Every other field, one added later
# included, changes the computation unless it is named here.
_WEIGHTS_UNAFFECTED = frozenset({"init_std", "max_sequence_length"})
# Fields that only set a derived size: they differ in effect only when that size does.
_SETS_DERIVED = {
    "n_kv_heads": "kv_heads",
    "mlp_hidden_size": "hidden_size",
    "mlp_multiple_of": "hidden_size",
}


def computation_changes(
    saved: TransformerConfig, now: TransformerConfig
) -> dict[str, tuple[Any, Any]]:
    """The fields of ``now`` that make weights trained under ``saved`` compute something
    else, as ``name -> (saved value, value now)``, in field order.

    Every field counts except ``init_std`` and ``max_sequence_length``, and a field that only
    sets a derived size (``n_kv_heads``: the key/value heads; ``mlp_hidden_size`` and
    ``mlp_multiple_of``: the MLP width) counts when that size differs: ``n_kv_heads=null``
    and ``n_kv_heads`` equal to ``n_heads`` are the same model. A field changing the tensor
    shapes (``d_model``) is named too.
    """
    changes: dict[str, tuple[Any, Any]] = {}
    for f in fields(saved):
        old, new = getattr(saved, f.name), getattr(now, f.name)
        if f.name in _WEIGHTS_UNAFFECTED or old == new:
            continue
        if f.name == "moe" and old is not None and new is not None:
            changes |= _moe_changes(saved, now)
            continue
        derived = _SETS_DERIVED.get(f.name)
        if derived is None or getattr(saved, derived) != getattr(now, derived):
            changes[f.name] = (_plain(old), _plain(new))
    return changes


# A mixture of experts' fields that change training only (the auxiliary losses' weights) or how
# the same numbers are computed: fine-tuning may change them.
_MOE_TRAINING_ONLY = frozenset(
    {"load_balancing_loss_coefficient", "router_z_loss_coefficient", "expert_compute"}
)


def _moe_changes(saved: TransformerConfig, now: TransformerConfig) -> dict[str, tuple[Any, Any]]:
    """:func:`computation_changes` of two mixtures of experts, as ``moe.<field>``: the same
    experts and routing, however written (``hidden_size`` unset or the dense width it stands
    for, ``layers`` unset or every layer), compute the same."""
    old, new = saved.moe, now.moe
    assert old is not None and new is not None
    effective = {
        "hidden_size": lambda c, m: m.hidden_size or c.hidden_size,
        "layers": lambda c, m: [i for i in range(c.n_layers) if m.is_moe_layer(i)],
    }
    changes: dict[str, tuple[Any, Any]] = {}
    for f in fields(old):
        if f.name in _MOE_TRAINING_ONLY:
            continue
        a, b = getattr(old, f.name), getattr(new, f.name)
        if a != b and (
            f.name not in effective or effective[f.name](saved, old) != effective[f.name](now, new)
        ):
            changes[f"moe.{f.name}"] = (_plain(a), _plain(b))
    return changes


def _plain(value: Any) -> Any:
    """A field's value as a config file writes it: an option's value, a section as a dict."""
    if isinstance(value, Config):
        return {k: v for k, v in value.as_config_dict().items() if k != Config.CLASS_NAME_FIELD}
    return value.value if isinstance(value, StrEnum) else value


def model_override(name: str, value: Any, prefix: str = "model") -> str:
    """The command-line override that sets the model config's field ``name`` to ``value``
    (a plain value, as :func:`computation_changes` gives it), e.g. ``--model.n_heads=4``."""
    if value is None:
        return f"--{prefix}.{name}=null"
    if isinstance(value, dict):
        return " ".join(model_override(f"{name}.{k}", v, prefix) for k, v in value.items())
    if isinstance(value, bool):
        return f"--{prefix}.{name}={str(value).lower()}"
    return f"--{prefix}.{name}={value}"


# Its name before it moved here from olmolike.nn.transformer: every config.json saved with a
# checkpoint until then names it so.
register_config_class(TransformerConfig, "olmolike.nn.transformer.TransformerConfig")
