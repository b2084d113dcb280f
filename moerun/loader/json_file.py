"""The JSON of a checkpoint (config.json, the shard index, tokenizer configs and generation_config.json,
a safetensors header), parsed so that every failure is one error naming the file: bytes that are not
UTF-8, text that is not JSON, nesting deeper than Python's parser goes, an integer of more digits
than Python converts, a key given twice where the format forbids it, or a value of the wrong kind."""

from __future__ import annotations

import json
import os
from pathlib import Path

from moerun.errors import CheckpointError, quote


def parse_json(
    raw: bytes | str,
    where: str | os.PathLike,
    kind: type | None = dict,
    error: type[CheckpointError] = CheckpointError,
    unique_keys: bool = False,
) -> object:
    """`raw` parsed; `kind` (when given) is the type the top-level value must have. `unique_keys`:
    an object naming a key twice is refused (the safetensors format forbids it)."""

    def pairs(items: list[tuple[str, object]]) -> dict:
        out = dict(items)
        if len(out) != len(items):
            seen: set[str] = set()
            twice = next(k for k, _ in items if k in seen or seen.add(k))
            raise error(f"{where}: the key {quote(twice)} appears twice in one JSON object.")
        return out

    try:
        text = raw.decode("utf-8") if isinstance(raw, bytes) else raw  # json.loads would guess UTF-16
        value = json.loads(text, object_pairs_hook=pairs if unique_keys else None)
    except CheckpointError:
        raise
    except RecursionError:
        raise error(f"{where}: the JSON is nested deeper than moerun reads.") from None
    except UnicodeDecodeError as e:
        raise error(f"{where}: not UTF-8 text (byte {e.start} is {raw[e.start : e.start + 1]!r}).") from None
    except ValueError as e:  # JSONDecodeError, and integers of more digits than int() takes
        raise error(f"{where}: not valid JSON ({str(e)[:120]}).") from None
    if kind is not None and not isinstance(value, kind):
        raise error(f"{where}: holds a JSON {_json_kind(value)}, not an {_json_kind(kind())}.")
    return value


def read_json(
    path: str | os.PathLike, kind: type | None = dict, error: type[CheckpointError] = CheckpointError
) -> object:
    """The JSON file at `path`, parsed as `parse_json` does."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise error(f"{path}: cannot be read ({e.strerror}).") from None
    return parse_json(raw, path, kind, error)


def _json_kind(value: object) -> str:
    names = {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}
    return names.get(type(value), "number")
