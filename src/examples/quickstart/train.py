"""Train a tiny causal language model on synthetic tokens."""

import sys

import torch

from olmolike.data import TokenTensorDataLoader
from olmolike.testing import TinyCausalLM, random_token_instances
from olmolike.train import (
    BasicTrainModule,
    Duration,
    TrainerConfig,
    prepare_training_environment,
    teardown_training_environment,
)
from olmolike.train.callbacks import ConsoleLoggerCallback
from olmolike.utils import get_default_device

SEQ_LEN = 32


def main(overrides: list[str]) -> None:
    # Trainer settings, with command-line overrides such as --max_duration.value=20.
    config = TrainerConfig(
        save_folder="runs/tiny",
        max_duration=Duration.steps(30),
        metrics_collect_interval=5,
        callbacks={"console_logger": ConsoleLoggerCallback(log_interval=5)},
    ).merge(overrides)

    # What one step does: the model, its optimizer and the loss.
    device = get_default_device()  # this rank's GPU if there is one, else the CPU
    model = TinyCausalLM(vocab_size=64, d_model=32, n_layers=2, n_heads=2, max_seq_len=SEQ_LEN)
    model = model.to(device)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_module = BasicTrainModule(
        model, optim, rank_microbatch_size=4 * SEQ_LEN, max_grad_norm=1.0
    )

    # Which tokens come next: 1,024 instances of 32 tokens, 8 instances per step.
    data_loader = TokenTensorDataLoader(
        random_token_instances(1024, SEQ_LEN, vocab_size=64),
        global_batch_size=8 * SEQ_LEN,
        seed=0,
    )

    trainer = config.build(train_module, data_loader)
    trainer.fit()


if __name__ == "__main__":
    prepare_training_environment(seed=0)
    main(sys.argv[1:])
    teardown_training_environment()
