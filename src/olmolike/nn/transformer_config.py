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

__all__ = ["TransformerConfig", "TransformerPreset"]

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
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int | None = None
    mlp_hidden_size: int | None = None
    mlp_multiple_of: int = 256
    max_sequence_length: int = 4096
    rope_theta: float = 500_000.0
    rope_scaling: RopeScalingConfig | None = None
    norm_eps: float = 1e-6
    qk_norm: bool = False
    tie_weights: bool = False
    block_type: TransformerBlockType = TransformerBlockType.default
    init_std: float = 0.02
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


# Its name before it moved here from olmolike.nn.transformer: every config.json saved with a
# checkpoint until then names it so.
register_config_class(TransformerConfig, "olmolike.nn.transformer.TransformerConfig")
