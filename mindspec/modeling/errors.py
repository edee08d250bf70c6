"""Checkpoint errors: each message is one sentence a user can act on, naming tensor and file."""


class CheckpointError(Exception):
    """The checkpoint cannot be loaded into the model."""


class NotACheckpointError(CheckpointError):
    """The directory is not a (supported) model checkpoint."""


class MissingTensorError(CheckpointError):
    """A tensor the model needs is absent."""


class UnexpectedTensorError(CheckpointError):
    """The checkpoint holds a tensor the model has no place for."""


class ShapeMismatchError(CheckpointError):
    """A tensor's shape differs from what the config implies."""


class UnsupportedCheckpointError(CheckpointError):
    """The checkpoint uses a format this build cannot load (FP8, unknown architecture)."""
