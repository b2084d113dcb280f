"""A `tokenizers.Tokenizer` rebuilt from a GGUF file's metadata (llama.cpp's `tokenizer.ggml.*` keys).

A GGUF file carries no tokenizer.json: it stores the vocabulary (`tokens`, `scores`, `token_type`),
the BPE `merges` for byte-level vocabularies, the special token ids and a name for the way text is cut
into words before BPE (`tokenizer.ggml.pre`). Two kinds are rebuilt here, the way transformers'
GGUF tokenizer loading builds them (`integrations/gguf/gguf_tokenizer_mapping.py`):

- "llama": SentencePiece-style BPE. Spaces are spelled `▁` and a `▁` is put before the text;
  characters outside the vocabulary fall back to `<0xNN>` byte tokens. Merges come from the file if
  it has them, else from the vocabulary: every way of cutting a token into two tokens is a merge,
  ranked by the whole token's score.
- "gpt2": byte-level BPE with the file's merges; every byte is spelled as one printable character
  (GPT-2's table), and a regular expression named by `tokenizer.ggml.pre` cuts text into words.

Token types (llama.cpp's): 1 normal, 2 unknown, 3 control, 4 user defined, 5 unused, 6 byte. Control
tokens become special tokens (matched whole in text, dropped by `decode(skip_special_tokens=True)`),
user-defined ones plain added tokens (matched whole, kept by decode); in a byte-level vocabulary both
keep the text the file gives them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from numbers import Integral

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as Backend

CONTROL, USER_DEFINED = 3, 4

# The regular expressions that cut text into words, as llama.cpp and the models' tokenizer.json write
# them; llama.cpp's names for them (`tokenizer.ggml.pre`) are the keys of PRE_TOKENIZERS below.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _char_class(*ranges: tuple[int, ...]) -> str:
    """A character class of code points and (first, last) ranges, written as \\x{...} escapes so no
    editor's Unicode normalisation can change it (several of these letters have canonical twins)."""
    return "[" + "".join("-".join(f"\\x{{{c:x}}}" for c in r) for r in ranges) + "]"


_KANA = _char_class((0x4E00, 0x9FA5), (0x3040, 0x309F), (0x30A0, 0x30FF))  # 一-龥, hiragana, katakana
_DEEPSEEK_V3 = (
    r"\p{N}{1,3}",
    _KANA + "+",
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)
# DeepSeek-LLM's letters: the runs of cased letters (Lu, Ll, Lt), as llama.cpp and tokenizer.json list them.
_DEEPSEEK_LLM_LETTERS = _char_class(
    (0x41, 0x5A), (0x61, 0x7A), (0xB5,), (0xC0, 0xD6), (0xD8, 0xF6), (0xF8, 0x1BA), (0x1BC, 0x1BF),
    (0x1C4, 0x293), (0x295, 0x2AF), (0x370, 0x373), (0x376,), (0x377,), (0x37B, 0x37D), (0x37F,),
    (0x386,), (0x388, 0x38A), (0x38C,), (0x38E, 0x3A1), (0x3A3, 0x3F5), (0x3F7, 0x481), (0x48A, 0x52F),
    (0x531, 0x556), (0x10A0, 0x10C5), (0x13A0, 0x13F5), (0x13F8, 0x13FD), (0x1C90, 0x1CBA),
    (0x1CBD, 0x1CBF), (0x1D00, 0x1D2B), (0x1D6B, 0x1D77), (0x1D79, 0x1D9A), (0x1E00, 0x1F15),
    (0x1F18, 0x1F1D), (0x1F20, 0x1F45), (0x1F48, 0x1F4D), (0x1F50, 0x1F57), (0x1F59,), (0x1F5B,),
    (0x1F5D,), (0x1F5F, 0x1F7D), (0x1F80, 0x1FB4), (0x1FB6, 0x1FBC), (0x1FBE,), (0x1FC2, 0x1FC4),
    (0x1FC6, 0x1FCC), (0x1FD0, 0x1FD3), (0x1FD6, 0x1FDB), (0x1FE0, 0x1FEC), (0x1FF2, 0x1FF4),
    (0x1FF6, 0x1FFC), (0x2102,), (0x2107,), (0x210A, 0x2113), (0x2115,), (0x2119, 0x211D), (0x2124,),
    (0x2126,), (0x2128,), (0x212A, 0x212D), (0x212F, 0x2134), (0x2139,), (0x213C, 0x213F),
    (0x2145, 0x2149), (0x214E,), (0x2183,), (0x2184,), (0x2C00, 0x2C7B), (0x2C7E, 0x2CE4),
    (0x2CEB, 0x2CEE), (0x2CF2,), (0x2CF3,), (0xA640, 0xA66D), (0xA680, 0xA69B), (0xA722, 0xA76F),
    (0xA771, 0xA787), (0xA78B, 0xA78E), (0xAB70, 0xABBF), (0xFB00, 0xFB06), (0xFB13, 0xFB17),
    (0xFF21, 0xFF3A), (0xFF41, 0xFF5A), (0x10400, 0x1044F), (0x104B0, 0x104D3), (0x104D8, 0x104FB),
    (0x10C80, 0x10CB2), (0x10CC0, 0x10CF2), (0x118A0, 0x118DF), (0x1E900, 0x1E943),
)  # fmt: skip
_DEEPSEEK_LLM = (
    r"[\r\n]",
    r"\s?" + _DEEPSEEK_LLM_LETTERS + "+",
    # ASCII and full-width punctuation, curly quotes, the ideographic space, comma and full stop
    r"\s?"
    + _char_class(
        (0x21, 0x2F), (0x3A, 0x7E), (0xFF01, 0xFF0F), (0xFF1A, 0xFF5E), (0x2018, 0x201F), (0x3000, 0x3002)
    )
    + "+",
    r"\s+$",
    _char_class((0x4E00, 0x9FA5), (0x800, 0x4E00), (0xAC00, 0xD7FF)) + "+",  # CJK, U+0800.., Hangul
    r"\p{N}+",
)


# Llama 3's vocabulary and the ones made from it; llama.cpp adds BOS for them if the file does not say.
_LLAMA3_NAMES = "llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2"


def _names(names: str, splits: tuple[str, ...]) -> dict[str, tuple[str, ...]]:
    return dict.fromkeys(names.split(), splits)


# `tokenizer.ggml.pre` -> the expressions applied in turn, each piece they match kept as its own word.
# transformers reads "default" (and any name it does not know) as GPT-2's expression; llama.cpp has a
# longer chain for "default", but byte-level files that say "default" were made for GPT-2's.
PRE_TOKENIZERS: dict[str, tuple[str, ...]] = {
    **_names("default gpt2 gpt-2 olmo mpt jais phi-2 trillion roberta-bpe", (_GPT2,)),
    # llama.cpp: digits one by one, then GPT-2's expression (Granite, StarCoder, Command R)
    **_names("refact starcoder command-r smollm codeshell exaone minerva", (r"\p{N}", _GPT2)),
    **_names(_LLAMA3_NAMES, (_LLAMA3,)),
    **_names("dbrx smaug-bpe", (_LLAMA3,)),
    **_names("qwen2 deepseek-r1-qwen kormo megrez stablelm2", (_QWEN2,)),
    **_names("qwen35", (_QWEN35,)),
    **_names("tekken", (_TEKKEN,)),
    **_names("gpt-4o llama4 minimax-m2", (_GPT4O,)),
    **_names("deepseek-v3", _DEEPSEEK_V3),
    **_names("deepseek-llm", _DEEPSEEK_LLM),
}

# llama.cpp stops generating at these besides the ids the file names (`llama_vocab::impl::load`).
END_OF_GENERATION_TEXTS = frozenset(
    {
        "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<end_of_turn>", "<|endoftext|>",
        "<|eom_id|>", "<EOT>", "_<EOT>", "<|end_of_text|>", "<end_of_utterance>", "<｜end▁of▁sentence｜>",
    }
)  # fmt: skip

# SentencePiece vocabularies whose model puts the leading `▁` in with a normalizer, not a
# pre-tokenizer: it shows only on text that starts with spaces (Phi-3's tokenizer.json; PhiMoE's is
# the same file).
_NORMALIZER_PREFIX_ARCHS = frozenset({"phi3", "phimoe"})


@dataclass(frozen=True)
class GGUFVocab:
    """The tokenizer a GGUF file describes: the backend, its special tokens by name (the text of the
    token, or None), whether encode adds BOS/EOS, the ids that end generation, the chat template."""

    backend: Backend
    bos_token: str | None
    eos_token: str | None
    unk_token: str | None
    pad_token: str | None
    add_bos: bool
    add_eos: bool
    eos_ids: frozenset[int]
    chat_template: str | None


@cache
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's spelling of each byte as one printable character: printable Latin-1 bytes stand for
    themselves, the other 68 are moved up to U+0100 and on."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    moved = [b for b in range(256) if b not in keep]
    return {**{b: chr(b) for b in keep}, **{b: chr(256 + i) for i, b in enumerate(moved)}}


def read_gguf_vocab(metadata: Mapping[str, object]) -> GGUFVocab:
    """Build the tokenizer described by `metadata` (as `moerun.loader.GGUFFile(path).metadata` holds
    it). Raises ValueError naming what is missing or not supported."""
    kind = metadata.get("tokenizer.ggml.model")
    tokens = metadata.get("tokenizer.ggml.tokens")
    if kind is None or tokens is None:
        raise ValueError(
            "the GGUF metadata has no tokenizer (tokenizer.ggml.model and tokenizer.ggml.tokens are missing)."
        )
    tokens = list(tokens)
    types = [int(t) for t in metadata.get("tokenizer.ggml.token_type", ())]
    arch = str(metadata.get("general.architecture", ""))
    if kind == "llama":
        backend = _sentencepiece(metadata, tokens, arch)
    elif kind == "gpt2":
        backend = _byte_level(metadata, tokens, types)
    else:
        raise ValueError(
            f"the GGUF tokenizer kind {kind!r} (tokenizer.ggml.model) is not supported; "
            "moerun reads 'llama' (SentencePiece BPE) and 'gpt2' (byte-level BPE)."
        )

    control = [
        AddedToken(text, normalized=False, special=True)
        for text, kind_of in zip(tokens, types, strict=False)
        if kind_of == CONTROL
    ]
    backend.add_special_tokens(control)
    vocab = backend.get_vocab()
    backend.add_tokens(
        [
            AddedToken(text, normalized=False, special=False)
            for text, kind_of in zip(tokens, types, strict=False)
            if kind_of == USER_DEFINED and text in vocab
        ]
    )

    def named(key: str) -> str | None:
        token_id = metadata.get(f"tokenizer.ggml.{key}")
        return tokens[token_id] if _is_id(token_id, len(tokens)) else None

    # Files written before the flag existed: llama.cpp adds BOS for SentencePiece and Llama-3 vocabularies.
    add_bos = metadata.get("tokenizer.ggml.add_bos_token")
    if add_bos is None:
        add_bos = kind == "llama" or metadata.get("tokenizer.ggml.pre") in _LLAMA3_NAMES.split()
    eos_ids = {
        int(token_id)
        for key in ("eos_token_id", "eot_token_id", "eom_token_id")
        if _is_id(token_id := metadata.get(f"tokenizer.ggml.{key}"), len(tokens))
    }
    eos_ids |= {
        i
        for i, text in enumerate(tokens)
        if text in END_OF_GENERATION_TEXTS and backend.token_to_id(text) == i
    }
    template = metadata.get("tokenizer.chat_template")
    return GGUFVocab(
        backend=backend,
        bos_token=named("bos_token_id"),
        eos_token=named("eos_token_id"),
        unk_token=named("unknown_token_id"),
        pad_token=named("padding_token_id"),
        add_bos=bool(add_bos),
        add_eos=bool(metadata.get("tokenizer.ggml.add_eos_token", False)),
        eos_ids=frozenset(eos_ids),
        chat_template=template if isinstance(template, str) else None,
    )


def _is_id(value, n_tokens: int) -> bool:
    return isinstance(value, Integral) and not isinstance(value, bool) and 0 <= value < n_tokens


def _sentencepiece(metadata: Mapping[str, object], tokens: list[str], arch: str) -> Backend:
    vocab = {text: i for i, text in enumerate(tokens)}
    if "tokenizer.ggml.merges" in metadata:
        merges = [tuple(m.split(" ")) for m in metadata["tokenizer.ggml.merges"]]
    elif "tokenizer.ggml.scores" in metadata:
        merges = merges_from_scores(tokens, [float(s) for s in metadata["tokenizer.ggml.scores"]])
    else:
        raise ValueError(
            "the GGUF SentencePiece vocabulary has neither tokenizer.ggml.scores nor tokenizer.ggml.merges."
        )
    backend = Backend(models.BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True, dropout=None))
    # transformers always puts the `▁` in front; llama.cpp honours the file's flag, and so do we.
    prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
    if arch in _NORMALIZER_PREFIX_ARCHS:
        steps = [normalizers.Prepend("▁")] if prefix else []
        backend.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "▁")])
    else:
        backend.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement="▁", prepend_scheme="first" if prefix else "never", split=False
        )
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(steps)
    return backend


def _byte_level(metadata: Mapping[str, object], tokens: list[str], types: list[int]) -> Backend:
    pre = metadata.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise ValueError(
            f"the GGUF byte-level tokenizer names the pre-tokenizer {pre!r} (tokenizer.ggml.pre), which "
            f"moerun does not know; known: {', '.join(sorted(PRE_TOKENIZERS))}."
        )
    if "tokenizer.ggml.merges" not in metadata:
        raise ValueError("the GGUF byte-level vocabulary has no tokenizer.ggml.merges.")
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    # Control and user-defined tokens are stored as their text ("<｜end▁of▁sentence｜>") and stay so:
    # they are matched whole, never built by merges, and decode to that text. Any other token outside
    # the byte alphabet is respelled in it, as merges would spell it (transformers respells the first
    # two kinds too, which leaves such special tokens unmatchable and their names pointing at new ids).
    kinds = types + [0] * (len(tokens) - len(types))
    vocab = {
        text
        if set(text) <= alphabet or kind in (CONTROL, USER_DEFINED)
        else "".join(spelling[b] for b in text.encode("utf-8", "surrogateescape")): i
        for i, (text, kind) in enumerate(zip(tokens, kinds, strict=True))
    }
    merges = [tuple(m.split(" ")) for m in metadata["tokenizer.ggml.merges"]]
    backend = Backend(
        models.BPE(
            vocab=vocab,
            merges=merges,
            dropout=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
        )
    )
    backend.pre_tokenizer = byte_level_pre_tokenizer(pre)
    backend.decoder = decoders.ByteLevel()
    return backend


def byte_level_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """Text cut into words by PRE_TOKENIZERS[pre], each word spelled in GPT-2's byte alphabet."""
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in PRE_TOKENIZERS[pre]]
    return pre_tokenizers.Sequence(
        [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )


def merges_from_scores(tokens: Sequence[str], scores: Sequence[float]) -> list[tuple[str, str]]:
    """BPE merges implied by a SentencePiece vocabulary: each way of cutting a token into two tokens
    is a merge ranked by the whole token's score (best first); ties go to the longer left part, then
    the longer right part, then to the token that comes first in the vocabulary, then to the cut
    whose parts have the smaller ids. The same list transformers derives (`generate_merges`), so the
    two tokenize alike."""
    vocab = {text: i for i, text in enumerate(tokens)}
    ranked = []
    for piece, score in dict(zip(tokens, scores, strict=True)).items():
        cuts = [(piece[:i], piece[i:]) for i in range(1, len(piece))]
        cuts = sorted(
            ((a, b) for a, b in cuts if a in vocab and b in vocab), key=lambda m: (vocab[m[0]], vocab[m[1]])
        )
        ranked.extend((a, b, score) for a, b in cuts)
    ranked.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(a, b) for a, b, _ in ranked]
