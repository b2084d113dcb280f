"""The errors a checkpoint can cause, as one hierarchy a caller can catch: `CheckpointError` and,
under it, `ConfigError` (config.json or GGUF metadata: a field missing, of the wrong type or out of
range), `GGUFMetadataError` (a GGUF metadata value that cannot be read as what it must be),
`TensorError` (tensor data: missing, mis-shaped, of the wrong dtype, overlapping) and
`TokenizerError` (tokenizer files; `moerun.load` only warns about those and loads the model without
text support). Each message is one sentence naming the file and the field or tensor; `quote` keeps
a quoted value (a name, a mutated string, a list) short enough for that sentence."""

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint file or directory that cannot be read or run: missing, truncated, malformed or of
    a kind moerun does not support. The message is one sentence naming the file (and the tensor or
    key)."""


class ConfigError(CheckpointError):
    """A config (config.json, or GGUF metadata read as one) describing a model moerun cannot run."""


class GGUFMetadataError(ConfigError):
    """A GGUF metadata value of the wrong type or out of range."""


class TensorError(CheckpointError):
    """Tensors that do not fit the model: missing, mis-shaped, of the wrong dtype, or stored
    overlapping other tensors."""


class TokenizerError(CheckpointError):
    """Tokenizer files (tokenizer.json, its configs, a GGUF vocabulary) that cannot be read."""


QUOTE_LIMIT = 60  # characters of a quoted value


def quote(value: object, limit: int = QUOTE_LIMIT) -> str:
    """repr(value), cut to about `limit` characters (a mutated name or a huge list stays readable)."""
    return shorten(repr(value), limit)


def shorten(text: str, limit: int = QUOTE_LIMIT) -> str:
    """`text`, or its first characters and how long it was."""
    return text if len(text) <= limit else f"{text[: limit - 12]}...({len(text)} chars)"


def in_file(error: CheckpointError, path: object) -> CheckpointError:
    """`error` with its message prefixed by `path`, unless it names the file already."""
    message = str(error)
    return error if str(path) in message else type(error)(f"{path}: {message}")
