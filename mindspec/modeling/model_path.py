"""Where a model's weights are: a checkpoint directory or a GGUF file. Checked without torch, so a
wrong ``--model`` or ``modelWeightPath`` answers before anything heavy loads."""
from __future__ import annotations

from pathlib import Path

from .errors import NotACheckpointError

GGUF_SUFFIX = ".gguf"


def is_gguf(path: str | Path) -> bool:
    return str(path).endswith(GGUF_SUFFIX)


def check_model_dir(path: str | Path) -> Path:
    """The checkpoint directory as a Path; NotACheckpointError if it is missing or a file."""
    path = Path(path)
    if not path.exists():
        raise NotACheckpointError(f"model directory {str(path)!r} does not exist")
    if not path.is_dir():
        raise NotACheckpointError(f"{str(path)!r} is not a directory; pass the checkpoint directory")
    return path


def check_model_path(path: str | Path) -> Path:
    """A GGUF file that exists, or a checkpoint directory that exists (what is inside is the
    loader's to check)."""
    if is_gguf(path):
        if not Path(path).is_file():
            raise NotACheckpointError(f"GGUF file {str(path)!r} does not exist")
        return Path(path)
    return check_model_dir(path)
