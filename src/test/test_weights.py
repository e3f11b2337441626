"""load_pretrained_weights and init_weights: start a run from HF weights or another run's."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import preloaded_python
import pytest
import torch
from hf_models import VOCAB, hf_logits, hf_model, save_hf_model, token_ids
from remote_servers import RemoteStore
from testutils import build_trainer, patient, run_distributed_test
from torch.distributed.tensor import DTensor

from olmolike import io
from olmolike.data import TokenTensorDataLoader
from olmolike.distributed.parallel import DataParallelConfig
from olmolike.distributed.utils import broadcast_object, get_rank, get_world_size
from olmolike.exceptions import ConfigurationError
from olmolike.nn import Transformer, TransformerConfig, load_hf_model
from olmolike.nn.hf_import import read_hf_config, transformer_config_from_hf
from olmolike.nn.rope import RopeScalingConfig
from olmolike.optim import AdamWConfig
from olmolike.testing import random_token_instances
from olmolike.train import Callback, Duration, Trainer, TrainerConfig
from olmolike.train.callbacks import CheckpointerCallback, InitWeightsCallback
from olmolike.train.train_module import TransformerTrainModuleConfig
from olmolike.train.weights import load_pretrained_weights

pytest.importorskip("transformers")

SEQ_LEN = 16


def config_of(hf_dir: Path | str) -> TransformerConfig:
    return transformer_config_from_hf(read_hf_config(hf_dir))


def state_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Full tensors (gathered if sharded), unwrapped from DDP."""
    inner = getattr(model, "module", model)
    return {
        name: (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()
        for name, t in inner.state_dict().items()
    }


def model_of(trainer: Trainer) -> torch.nn.Module:
    return trainer.train_module.model  # type: ignore[attr-defined,no-any-return]


def assert_same_state(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name, tensor in got.items():
        assert torch.equal(tensor, want[name]), name


# -- one process ---------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "olmo2"])
def test_hf_folder_into_a_randomly_initialised_model(tmp_path: Path, arch: str) -> None:
    theirs = save_hf_model(tmp_path, arch)
    model = config_of(tmp_path).build(seed=7).eval()
    before = state_of(model)
    load_pretrained_weights(model, str(tmp_path))
    assert not torch.equal(before["norm.weight"], model.norm.weight)
    ids = token_ids()
    with torch.no_grad():
        assert (model(ids) - hf_logits(theirs, ids)).abs().max().item() <= 1e-5


def test_weights_are_cast_to_the_models_dtype(tmp_path: Path) -> None:
    save_hf_model(tmp_path, "llama").to(torch.bfloat16).save_pretrained(tmp_path)
    model = config_of(tmp_path).build(seed=7)
    load_pretrained_weights(model, str(tmp_path))
    assert model.embeddings.weight.dtype == torch.float32
    reference = load_hf_model(tmp_path, dtype=torch.float32)
    assert_same_state(state_of(model), state_of(reference))


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"vocab_size": VOCAB + 1}, f"--model.vocab_size={VOCAB}"),
        ({"n_kv_heads": None}, "--model.n_kv_heads=2"),
        ({"block_type": "default", "qk_norm": False}, "--model.block_type=reordered_norm"),
        ({"rope_theta": 10_000.0}, "--model.rope_theta=4321.0"),
        ({"rope_scaling": RopeScalingConfig()}, "--model.rope_scaling=null"),
    ],
)
def test_a_model_of_another_shape_is_refused(
    tmp_path: Path, overrides: dict[str, Any], expected: str
) -> None:
    save_hf_model(tmp_path, "olmo2")
    model = config_of(tmp_path).replace(**overrides).build(seed=0)
    before = state_of(model)
    with pytest.raises(ConfigurationError, match="not built like the weights") as error:
        load_pretrained_weights(model, str(tmp_path))
    assert expected in str(error.value)
    assert_same_state(state_of(model), before)


def test_neither_an_hf_folder_nor_a_checkpoint(tmp_path: Path) -> None:
    model = TransformerConfig(vocab_size=8, d_model=16, n_layers=1, n_heads=2).build()
    with pytest.raises(ConfigurationError, match="is neither a Hugging Face model folder"):
        load_pretrained_weights(model, str(tmp_path))


def test_a_meta_model_is_refused(tmp_path: Path) -> None:
    model = TransformerConfig(vocab_size=8, d_model=16, n_layers=1, n_heads=2).build(
        init_device="meta"
    )
    with pytest.raises(ConfigurationError, match="materialise"):
        load_pretrained_weights(model, str(tmp_path))


# -- training runs -------------------------------------------------------------------------


@dataclass
class StartLogits(Callback):
    """The logits of fixed ids just before the first step's forward, and the losses."""

    ids: torch.Tensor = field(default_factory=lambda: token_ids(SEQ_LEN))
    logits: torch.Tensor | None = None
    losses: dict[int, float] = field(default_factory=dict)
    priority: ClassVar[int] = -10

    def pre_step(self, batch: dict[str, Any]) -> None:
        if self.logits is None:
            self.logits = self.trainer.train_module.eval_batch({"input_ids": self.ids})

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        self.losses[step] = metrics["train/CE loss"]


def build_run(
    save_folder: str | Path,
    model_config: TransformerConfig,
    *,
    init_weights: str | None,
    dp: dict[str, Any] | None = None,
    steps: int = 4,
    **trainer_kwargs: Any,
) -> tuple[Trainer, StartLogits]:
    rank_instances = 4 // get_world_size()
    module = TransformerTrainModuleConfig(
        rank_microbatch_size=rank_instances * SEQ_LEN,
        optim=AdamWConfig(lr=1e-2),
        init_weights=init_weights,
        dp_config=None if dp is None else DataParallelConfig.from_dict(dp),
    ).build(model_config.build(init_device="meta"))
    loader = TokenTensorDataLoader(
        random_token_instances(32, SEQ_LEN, model_config.vocab_size, seed=1),
        global_batch_size=4 * SEQ_LEN,
        seed=0,
    )
    probe = StartLogits()
    trainer = TrainerConfig(
        save_folder=str(save_folder),
        max_duration=Duration.steps(steps),
        metrics_collect_interval=1,
        device="cpu",
        callbacks={"probe": probe, "checkpointer": CheckpointerCallback(save_interval=2)},
        **trainer_kwargs,
    ).build(module, loader)
    return trainer, probe


@pytest.mark.parametrize("arch", ["llama", "olmo2"])
def test_run_from_an_hf_folder_starts_at_its_logits(tmp_path: Path, arch: str) -> None:
    theirs = save_hf_model(tmp_path / "hf", arch)
    trainer, probe = build_run(
        tmp_path / "run", config_of(tmp_path / "hf"), init_weights=str(tmp_path / "hf")
    )
    trainer.fit()
    assert probe.logits is not None
    assert (probe.logits - hf_logits(theirs, probe.ids)).abs().max().item() <= 1e-5
    assert trainer.global_step == 4
    assert trainer.train_module.optim.state  # type: ignore[attr-defined]


def test_resumed_run_takes_its_own_checkpoint_not_the_init_weights(tmp_path: Path) -> None:
    save_hf_model(tmp_path / "hf", "llama")
    config = config_of(tmp_path / "hf")
    full, full_probe = build_run(tmp_path / "full", config, init_weights=str(tmp_path / "hf"))
    full.fit()
    first, _ = build_run(
        tmp_path / "resumed", config, init_weights=str(tmp_path / "hf"), hard_stop=Duration.steps(2)
    )
    first.fit()
    # The init weights are gone: a resume that read them would fail (or start over from them).
    second, second_probe = build_run(
        tmp_path / "resumed", config, init_weights=str(tmp_path / "gone")
    )
    second.fit()
    assert second_probe.losses == {s: full_probe.losses[s] for s in (3, 4)}
    assert_same_state(state_of(model_of(second)), state_of(model_of(full)))


def test_run_from_another_runs_checkpoint_gets_weights_only(tmp_path: Path) -> None:
    save_hf_model(tmp_path / "hf", "olmo2")
    config = config_of(tmp_path / "hf")
    base, _ = build_run(tmp_path / "base", config, init_weights=str(tmp_path / "hf"))
    base.fit()
    # From the save folder (its newest checkpoint): same weights, fresh step count and optimizer.
    tuned, probe = build_run(
        tmp_path / "tuned", config, init_weights=str(tmp_path / "base"), steps=1
    )
    assert not tuned.train_module.optim.state  # type: ignore[attr-defined]
    tuned.fit()
    base_model = model_of(base)
    with torch.no_grad():
        expected = base_model.eval()(probe.ids)
    assert probe.logits is not None and torch.equal(probe.logits, expected)
    assert tuned.global_step == 1


@dataclass
class HeldAtStart(Callback):
    """The model's weights when the callbacks' ``pre_train`` runs, after InitWeightsCallback's."""

    held: dict[str, torch.Tensor] = field(default_factory=dict)
    priority: ClassVar[int] = -10

    def pre_train(self) -> None:
        self.held = state_of(model_of(self.trainer))


def test_init_weights_callback_starts_a_users_own_train_module_unless_it_resumed(
    tmp_path: Path,
) -> None:
    # A BasicTrainModule has no init_weights field: the public callback gives it the same
    # start, loading in its pre_train, and a resumed run keeps its own weights.
    base = build_trainer(tmp_path / "base", max_duration=Duration.steps(2))
    base.fit()
    probe = HeldAtStart()
    callbacks = {"init": InitWeightsCallback(source=str(tmp_path / "base")), "probe": probe}
    fresh = build_trainer(
        tmp_path / "run", seed=1, max_duration=Duration.steps(2), callbacks=callbacks
    )
    fresh.fit()
    assert_same_state(probe.held, state_of(model_of(base)))
    probe = HeldAtStart()
    gone = InitWeightsCallback(source=str(tmp_path / "gone"))  # a resume never reads it
    resumed = build_trainer(
        tmp_path / "run",
        seed=1,
        max_duration=Duration.steps(3),
        callbacks={"init": gone, "probe": probe},
    )
    resumed.fit()
    assert resumed.global_step == 3
    assert_same_state(probe.held, state_of(model_of(fresh)))


def test_a_checkpoint_of_another_shape_is_refused(tmp_path: Path) -> None:
    save_hf_model(tmp_path / "hf", "llama")
    config = config_of(tmp_path / "hf")
    base, _ = build_run(tmp_path / "base", config, init_weights=str(tmp_path / "hf"), steps=2)
    base.fit()
    model = config.replace(mlp_hidden_size=48).build(seed=0)
    with pytest.raises(
        ConfigurationError, match=r"wrong shape: blocks.0.feed_forward.w_gate.weight"
    ):
        load_pretrained_weights(model, str(tmp_path / "base" / "step2"))


def test_init_weights_is_a_dotted_override_of_train_lm(tmp_path: Path) -> None:
    import subprocess

    train_lm = Path(__file__).parents[1] / "examples" / "train_lm" / "train.py"
    result = subprocess.run(
        [
            *preloaded_python.command(),
            str(train_lm),
            "demo",
            "--dry-run",
            "--train_module.init_weights=hf/base",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=patient(60),
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "init_weights: hf/base" in result.stdout


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_train_lm_starts_from_an_hf_folder(tmp_path: Path) -> None:
    """The command line of the docs: export a model, then train from it with one override."""
    import os
    import subprocess

    from olmolike.data.prepare import stdlib_python_files
    from olmolike.data.tokenizer import TokenizerConfig
    from olmolike.nn import export_hf

    sources = tmp_path / "sources"
    sources.mkdir()
    for path in stdlib_python_files()[:6]:
        (sources / path.name).write_bytes(path.read_bytes()[:20_000])
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cli = [*preloaded_python.command(), "-m", "olmolike.cli"]
    # Relative paths: the split hashes each source's name as given, so an absolute tmp path
    # would make the validation split (and its emptiness) differ from run to run.
    prepare = [*cli, "prepare-data", "sources", "-o", "data", "--val-fraction", "0.3"]
    subprocess.run(
        prepare, cwd=tmp_path, env=env, check=True, capture_output=True, timeout=patient(120)
    )
    vocab = TokenizerConfig().padded_vocab_size()
    base = TransformerConfig(
        vocab_size=vocab, d_model=32, n_layers=2, n_heads=2, max_sequence_length=64
    )
    export_hf(base.build(seed=4).state_dict(), base, tmp_path / "hf-model")
    train_lm = Path(__file__).parents[1] / "examples" / "train_lm" / "train.py"
    args = [
        "from-hf", "--model.d_model=32", "--model.n_layers=2", "--model.n_heads=2",
        "--model.max_sequence_length=64", "--dataset.sequence_length=64",
        "--dataset.paths=[data/train]",
        "--trainer.callbacks.lm_evaluator.eval_dataset.paths=[data/val]",
        "--trainer.callbacks.lm_evaluator.eval_dataset.sequence_length=64",
        "--trainer.callbacks.lm_evaluator.max_batches=1", "--trainer.max_duration.value=2",
        "--data_loader.global_batch_size=256", "--train_module.rank_microbatch_size=256",
        "--train_module.scheduler.warmup=1", "--train_module.init_weights=hf-model",
    ]  # fmt: skip
    result = subprocess.run(
        [*preloaded_python.command(), str(train_lm), *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=patient(300),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "loaded pretrained weights from hf-model" in result.stderr
    assert "Training done at step 2" in result.stderr


# -- two ranks ---------------------------------------------------------------------------


def _load_on_ranks(sources: list[str], dp: str) -> list[dict[str, torch.Tensor]]:
    """Each source loaded into a fresh model (seeded apart on each rank) under ``dp``."""
    from torch.distributed.device_mesh import init_device_mesh

    from olmolike.distributed.parallel import apply_ddp, apply_fsdp

    states = []
    for source in sources:
        model: torch.nn.Module = config_of_source(source).build(seed=10 + get_rank())
        if dp == "fsdp":
            apply_fsdp(model, init_device_mesh("cpu", (get_world_size(),)))
        else:
            model = apply_ddp(model)
        load_pretrained_weights(model, source)
        states.append(state_of(model))
    return states


def config_of_source(source: str) -> TransformerConfig:
    hf = Path(source) / "config.json"
    return config_of(source) if hf.exists() else config_of(Path(source).parent / "hf")


@pytest.fixture(scope="module")
def hf_folder_and_checkpoint(
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, dict[str, torch.Tensor]]:
    """A Hugging Face folder and the save folder of a 2-step run from its config, each with
    the weights one process reads from it (built once for both layouts)."""
    tmp_path = tmp_path_factory.mktemp("two_ranks")
    save_hf_model(tmp_path / "hf", "olmo2", tie_word_embeddings=True)
    base, _ = build_run(tmp_path / "base", config_of(tmp_path / "hf"), init_weights=None, steps=2)
    base.fit()
    return {
        str(tmp_path / "hf"): state_of(load_hf_model(tmp_path / "hf")),
        str(tmp_path / "base"): state_of(model_of(base)),
    }


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("dp", ["fsdp", "ddp"])
def test_two_ranks_load_hf_weights_and_checkpoints(
    hf_folder_and_checkpoint: dict[str, dict[str, torch.Tensor]], dp: str
) -> None:
    sources = list(hf_folder_and_checkpoint)
    for states in run_distributed_test(_load_on_ranks, 2, args=(sources, dp)):
        assert len(states) == len(sources)
        for state, source in zip(states, sources, strict=True):
            assert_same_state(state, hf_folder_and_checkpoint[source])


def _error_on_ranks(source: str) -> str:
    model = TransformerConfig(vocab_size=8, d_model=16, n_layers=1, n_heads=2).build()
    with pytest.raises(ConfigurationError) as error:
        load_pretrained_weights(model, source)
    return str(error.value)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_an_error_on_rank_0_reaches_every_rank(tmp_path: Path) -> None:
    """Rank 0 alone looks at the folder; the others must fail too, not wait for a broadcast."""
    first, second = run_distributed_test(_error_on_ranks, 2, args=(str(tmp_path),))
    assert "is neither a Hugging Face model folder" in first
    assert second.startswith("loading pretrained weights failed on rank 0: ConfigurationError")
    assert "is neither a Hugging Face model folder" in second


def _fsdp_run_from_hf(hf_dir: str) -> tuple[torch.Tensor, dict[int, float]]:
    save = broadcast_object(tempfile.mkdtemp())
    trainer, probe = build_run(save, config_of(hf_dir), init_weights=hf_dir, dp={"name": "fsdp"})
    trainer.fit()
    assert probe.logits is not None
    return probe.logits, probe.losses


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_fsdp_run_from_hf_weights_matches_one_process(tmp_path: Path) -> None:
    theirs = save_hf_model(tmp_path / "hf", "olmo2")
    single, single_probe = build_run(
        tmp_path / "one", config_of(tmp_path / "hf"), init_weights=str(tmp_path / "hf")
    )
    single.fit()
    for logits, losses in run_distributed_test(_fsdp_run_from_hf, 2, args=(str(tmp_path / "hf"),)):
        assert (logits - hf_logits(theirs, token_ids(SEQ_LEN))).abs().max().item() <= 1e-5
        torch.testing.assert_close(
            torch.tensor(list(losses.values())),
            torch.tensor(list(single_probe.losses.values())),
            rtol=1e-5,
            atol=1e-6,
        )


# -- remote folders ------------------------------------------------------------------------


@pytest.mark.timeout(180)
@pytest.mark.parametrize("bucket", ["gcs_bucket", "s3_bucket"])
def test_remote_hf_folder(tmp_path: Path, bucket: str, request: pytest.FixtureRequest) -> None:
    store: RemoteStore = request.getfixturevalue(bucket)
    theirs = hf_model("olmo2", tie_word_embeddings=True)
    theirs.save_pretrained(tmp_path / "hf", max_shard_size="20KB")  # sharded, with an index
    io.persist(tmp_path, store.url(), "hf")
    url = store.url("hf")
    ids = token_ids()
    for download in (None, tmp_path / "work"):
        model = config_of(tmp_path / "hf").build(seed=3).eval()
        load_pretrained_weights(model, url, work_dir=download)
        with torch.no_grad():
            assert (model(ids) - hf_logits(theirs, ids)).abs().max().item() <= 1e-5
    assert list((tmp_path / "work" / "hf-download" / "hf").glob("model-*.safetensors"))
    assert isinstance(load_hf_model(url), Transformer)


@pytest.mark.timeout(180)
def test_remote_checkpoint(tmp_path: Path, s3_bucket: RemoteStore) -> None:
    save_hf_model(tmp_path / "hf", "llama")
    config = config_of(tmp_path / "hf")
    base, _ = build_run(tmp_path / "base", config, init_weights=str(tmp_path / "hf"), steps=2)
    base.fit()
    io.persist(tmp_path, s3_bucket.url(), "base")
    model = config.build(seed=3)
    load_pretrained_weights(model, s3_bucket.url("base"))
    assert_same_state(state_of(model), state_of(model_of(base)))
