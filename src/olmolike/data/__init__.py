"""Data: tokenizers, token-file preparation, datasets, and loaders that resume exactly."""

from .data_loader import DataLoaderBase, TokenTensorDataLoader
from .numpy_data_loader import NumpyDataLoader, NumpyDataLoaderConfig, iter_eval_batches
from .numpy_dataset import NumpyDatasetConfig, NumpyFSLDataset, SourceMixtureConfig
from .prepare import PreparedData, prepare_data, stdlib_python_files
from .tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, TokenizerConfig

__all__ = [
    "ByteTokenizer",
    "DataLoaderBase",
    "HFTokenizer",
    "NumpyDataLoader",
    "NumpyDataLoaderConfig",
    "NumpyDatasetConfig",
    "NumpyFSLDataset",
    "PreparedData",
    "SourceMixtureConfig",
    "TokenTensorDataLoader",
    "Tokenizer",
    "TokenizerConfig",
    "iter_eval_batches",
    "prepare_data",
    "stdlib_python_files",
]
