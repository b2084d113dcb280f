"""The loader's one error type."""


class CheckpointError(ValueError):
    """A checkpoint file or directory that cannot be read: missing, truncated, malformed or of a kind
    moerun does not support. The message is one sentence naming the file (and the tensor or key)."""
