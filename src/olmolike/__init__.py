"""olmolike: a composable, exact-resume trainer for language models on PyTorch."""

__version__ = "0.1.0"
