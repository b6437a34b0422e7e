"""The one error a checkpoint that cannot be served raises."""


class CheckpointError(ValueError):
    """Names the file, the tensor, what was expected and what was found."""
