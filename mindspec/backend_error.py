"""BackendError, importable without torch (the command line catches it before anything loads torch)."""


class BackendError(RuntimeError):
    """A backend cannot be created here (unknown name, missing device or library)."""
