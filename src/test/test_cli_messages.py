"""Messages a command-line user reads name the command-line flag."""

from __future__ import annotations

from pathlib import Path

import pytest


def test_export_hf_refusal_names_the_command_line_flag(tmp_path: Path) -> None:
    """A CLI user is told the flag (``--overwrite``), not only the Python argument."""
    from olmolike.nn.hf_export import export_hf
    from olmolike.nn.transformer import TransformerConfig

    config = TransformerConfig(vocab_size=64, d_model=16, n_layers=1, n_heads=2)
    state = config.build(seed=0).state_dict()
    export_hf(state, config, tmp_path)
    with pytest.raises(FileExistsError, match=r"\(--overwrite\)"):
        export_hf(state, config, tmp_path)
