"""Data: tokenizers, token-file preparation, datasets, and loaders that resume exactly."""

from .chat_template import ChatTemplate
from .data_loader import DataLoaderBase, TokenTensorDataLoader
from .numpy_data_loader import NumpyDataLoader, NumpyDataLoaderConfig, iter_eval_batches
from .numpy_dataset import NumpyDatasetConfig, NumpyFSLDataset, SourceMixtureConfig
from .prepare import PreparedData, prepare_data, stdlib_python_files
from .sft import PackingMode, prepare_sft_data
from .sft_dataset import SFTDataset, SFTDatasetConfig
from .staged import StagedDataLoader
from .tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, TokenizerConfig, apply_chat_template

__all__ = [
    "ByteTokenizer",
    "ChatTemplate",
    "DataLoaderBase",
    "HFTokenizer",
    "NumpyDataLoader",
    "NumpyDataLoaderConfig",
    "NumpyDatasetConfig",
    "NumpyFSLDataset",
    "PackingMode",
    "PreparedData",
    "SFTDataset",
    "SFTDatasetConfig",
    "SourceMixtureConfig",
    "StagedDataLoader",
    "TokenTensorDataLoader",
    "Tokenizer",
    "TokenizerConfig",
    "apply_chat_template",
    "iter_eval_batches",
    "prepare_data",
    "prepare_sft_data",
    "stdlib_python_files",
]
