"""Data: loaders that know which tokens come next and resume exactly."""

from .data_loader import DataLoaderBase, TokenTensorDataLoader

__all__ = ["DataLoaderBase", "TokenTensorDataLoader"]
