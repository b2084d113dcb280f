"""A Hugging Face tokenizer (tokenizer.json and its configs) -> GGUF vocabulary metadata
(`tokenizer.ggml.*`, `tokenizer.chat_template`): the inverse of `moerun.text.gguf_vocab`, written as
llama.cpp's convert_hf_to_gguf.py writes a vocabulary.

- Byte-level BPE -> "gpt2": the tokens as tokenizer.json spells them (GPT-2's byte alphabet), its
  merges, and `pre`, llama.cpp's name for the regular expressions that cut text into words (read
  from the pre-tokenizer; convert_hf_to_gguf.py guesses it from a hash of sample encodings).
- SentencePiece-style BPE (byte fallback, `▁` for spaces) -> "llama": the tokens, scores (a merged
  token scores minus the rank of the first merge that makes it, so llama.cpp's SentencePiece
  tokenizer merges in BPE's order), `add_space_prefix`, and the merges too (moerun's reader uses
  them; llama.cpp ignores them for "llama").

Token types are llama.cpp's: 1 normal, 2 unknown (the model's unk token, SentencePiece only), 3 control
(special added tokens), 4 user defined (other added tokens), 5 unused (ids the tokenizer leaves
empty, written as `[PAD{id}]` up to the embedding's rows), 6 byte (`<0xNN>`). Whether encode adds
BOS/EOS is read from what the tokenizer does (its post-processor), as `Tokenizer.from_hf_dir` and
transformers 5 decide it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from moerun.text import Tokenizer
from moerun.text.gguf_vocab import PRE_TOKENIZERS

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
# llama.cpp's name for each word-splitting rule moerun reads (llama-vocab.cpp accepts all of these).
PRE_NAMES = {
    PRE_TOKENIZERS[name]: name
    for name in ("gpt-2", "qwen2", "qwen35", "llama-bpe", "gpt-4o", "tekken", "deepseek-v3", "deepseek-llm")
}
_GPT2_REGEX = PRE_TOKENIZERS["gpt-2"][0]  # what a ByteLevel pre-tokenizer with use_regex applies
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")
_PROBE = "a"  # text whose encodings with and without special tokens show what encode adds


class VocabError(ValueError):
    """A tokenizer that the GGUF vocabulary keys cannot describe."""


def vocab_metadata(directory: Path, vocab_size: int) -> dict[str, object]:
    """The `tokenizer.*` metadata of the checkpoint in `directory`, for a model whose embedding has
    `vocab_size` rows. Raises FileNotFoundError without tokenizer.json and VocabError for a tokenizer
    these keys cannot describe."""
    spec = json.loads((directory / "tokenizer.json").read_text(encoding="utf-8"))
    tokenizer = Tokenizer.from_hf_dir(directory)
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        raise VocabError(f"its model is {model.get('type')!r}; GGUF vocabularies moerun writes are BPE.")
    byte_level = _has_type(spec.get("pre_tokenizer"), "ByteLevel") or _has_type(
        spec.get("decoder"), "ByteLevel"
    )
    if not byte_level and not model.get("byte_fallback"):
        raise VocabError("it is BPE but neither byte-level nor with byte fallback (SentencePiece-style).")
    kind = "gpt2" if byte_level else "llama"
    tokens, types = _tokens_and_types(tokenizer, kind, model.get("unk_token"), vocab_size)
    merges = _merges(model.get("merges") or [])
    metadata: dict[str, object] = {"tokenizer.ggml.model": kind}
    if kind == "gpt2":
        metadata["tokenizer.ggml.pre"] = _pre_name(spec.get("pre_tokenizer"))
    else:
        metadata["tokenizer.ggml.pre"] = "default"  # as convert_hf_to_gguf.py (llama.cpp ignores it here)
    metadata["tokenizer.ggml.tokens"] = tokens
    metadata["tokenizer.ggml.token_type"] = np.asarray(types, dtype=np.int32)
    if kind == "llama":
        metadata["tokenizer.ggml.scores"] = _scores(tokens, merges)
        metadata["tokenizer.ggml.add_space_prefix"] = _adds_space_prefix(spec)
    metadata["tokenizer.ggml.merges"] = [f"{a} {b}" for a, b in merges]
    metadata.update(_special_ids(tokenizer, model.get("unk_token")))
    if tokenizer.chat_template is not None:
        metadata["tokenizer.chat_template"] = tokenizer.chat_template
    return metadata


def _has_type(component: dict | None, kind: str) -> bool:
    if not component:
        return False
    if component.get("type") == "Sequence":
        parts = component.get("pretokenizers") or component.get("decoders") or []
        return any(_has_type(part, kind) for part in parts)
    return component.get("type") == kind


def _tokens_and_types(
    tokenizer: Tokenizer, kind: str, unk: str | None, vocab_size: int
) -> tuple[list[str], list[int]]:
    backend = tokenizer.backend
    by_id = {i: text for text, i in backend.get_vocab(with_added_tokens=True).items()}
    added = backend.get_added_tokens_decoder()
    if max(by_id) >= vocab_size:
        raise VocabError(
            f"it has token ids up to {max(by_id)} but the model's embedding has {vocab_size} rows."
        )
    tokens, types = [], []
    for i in range(vocab_size):
        text = by_id.get(i)
        if text is None:
            tokens.append(f"[PAD{i}]")
            types.append(UNUSED)
        elif kind == "llama" and text == unk:
            tokens.append(text)
            types.append(UNKNOWN)
        elif i in added:
            tokens.append(text)
            types.append(CONTROL if added[i].special else USER_DEFINED)
        else:
            tokens.append(text)
            types.append(BYTE if kind == "llama" and _BYTE_TOKEN.fullmatch(text) else NORMAL)
    return tokens, types


def _merges(merges: list) -> list[tuple[str, str]]:
    """tokenizer.json's merges, as "a b" strings (older files) or [a, b] pairs."""
    out = []
    for merge in merges:
        a, b = merge.split(" ") if isinstance(merge, str) else merge
        if " " in a or " " in b:
            raise VocabError(
                f"the merge {merge!r} has a token with a space, which GGUF's 'a b' merges cannot hold."
            )
        out.append((a, b))
    return out


def _scores(tokens: list[str], merges: list[tuple[str, str]]) -> np.ndarray:
    rank: dict[str, int] = {}
    for i, (a, b) in enumerate(merges):
        rank.setdefault(a + b, i)
    return np.asarray([-float(rank.get(t, len(merges))) for t in tokens], dtype=np.float32)


def _adds_space_prefix(spec: dict) -> bool:
    """Whether the SentencePiece tokenizer puts a `▁` before the text: a Metaspace pre-tokenizer whose
    prepend_scheme is not "never", or a normalizer that prepends `▁` (Mixtral's legacy file)."""
    pre = spec.get("pre_tokenizer") or {}
    parts = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    for part in parts:
        if part.get("type") == "Metaspace":
            return part.get("prepend_scheme", "always") != "never" and part.get("add_prefix_space", True)
    normalizer = spec.get("normalizer") or {}
    steps = normalizer.get("normalizers", []) if normalizer.get("type") == "Sequence" else [normalizer]
    return any(step.get("type") == "Prepend" and step.get("prepend") == "▁" for step in steps)


def _pre_name(pre: dict | None) -> str:
    """llama.cpp's name for the regular expressions a byte-level pre-tokenizer cuts words with."""
    parts = (pre.get("pretokenizers") or []) if pre and pre.get("type") == "Sequence" else [pre or {}]
    regexes = []
    for part in parts:
        kind = part.get("type")
        if kind == "Split" and "Regex" in part.get("pattern", {}) and part.get("behavior") == "Isolated":
            if part.get("invert"):
                raise VocabError("its pre-tokenizer inverts a Split, which llama.cpp cannot do.")
            regexes.append(part["pattern"]["Regex"])
        elif kind == "ByteLevel":
            if part.get("add_prefix_space"):
                raise VocabError("its ByteLevel pre-tokenizer adds a prefix space, which llama.cpp does not.")
            if part.get("use_regex", True):
                regexes.append(_GPT2_REGEX)
        else:
            raise VocabError(f"its pre-tokenizer has a {kind} step that no llama.cpp pre-tokenizer matches.")
    name = PRE_NAMES.get(tuple(regexes))
    if name is None:
        raise VocabError(
            "its pre-tokenizer's regular expressions match none llama.cpp names "
            f"({', '.join(PRE_NAMES.values())})."
        )
    return name


def _special_ids(tokenizer: Tokenizer, unk: str | None) -> dict[str, object]:
    """BOS/EOS/UNK/PAD ids (the named special tokens), and whether encode adds BOS/EOS, read from what
    it does to a probe text."""
    plain = tokenizer.encode(_PROBE, add_special_tokens=False)
    full = tokenizer.encode(_PROBE, add_special_tokens=True)
    start = next((k for k in range(len(full) - len(plain) + 1) if full[k : k + len(plain)] == plain), None)
    if start is None:
        raise VocabError(
            "encoding with special tokens changes the text's own ids, which GGUF cannot describe."
        )
    front, back = full[:start], full[start + len(plain) :]
    if len(front) > 1 or len(back) > 1:
        raise VocabError(
            "encode adds more than one token before or after the text, which GGUF cannot describe."
        )
    ids = {
        "bos_token_id": tokenizer.token_to_id(tokenizer.special_tokens.get("bos_token")),
        "eos_token_id": tokenizer.token_to_id(tokenizer.special_tokens.get("eos_token")),
        "unknown_token_id": tokenizer.token_to_id(tokenizer.special_tokens.get("unk_token") or unk),
        "padding_token_id": tokenizer.token_to_id(tokenizer.special_tokens.get("pad_token")),
    }
    for key, added in (("bos_token_id", front), ("eos_token_id", back)):
        if added and ids[key] is None:
            ids[key] = added[0]
        elif added and added[0] != ids[key]:
            raise VocabError(
                f"encode adds token {added[0]}, not the {key[:3].upper()} token {ids[key]} its config names."
            )
    metadata: dict[str, object] = {f"tokenizer.ggml.{k}": v for k, v in ids.items() if v is not None}
    metadata["tokenizer.ggml.add_bos_token"] = bool(front)
    metadata["tokenizer.ggml.add_eos_token"] = bool(back)
    return metadata
