"""Text to token ids and back: `Tokenizer` wraps a `tokenizers.Tokenizer` read from a Hugging Face
checkpoint directory (tokenizer.json and its configs) or rebuilt from GGUF metadata, and encodes and
decodes as transformers' tokenizer does for the same files; `StreamDecoder` turns generated ids into
text one id at a time.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from tokenizers import AddedToken, processors
from tokenizers import Tokenizer as Backend

from moerun.errors import TokenizerError, quote, shorten
from moerun.loader.json_file import read_json
from moerun.text.chat_template import no_template_error
from moerun.text.chat_tools import render_conversation
from moerun.text.gguf_vocab import read_gguf_vocab

# The special tokens a tokenizer_config.json names (transformers' SPECIAL_TOKENS_ATTRIBUTES).
NAMED_SPECIAL_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
_REPLACEMENT = "\ufffd"  # what decoding writes for bytes that are not (yet) whole UTF-8 characters


class Tokenizer:
    """Encode text to ids and decode ids to text.

    `special` maps the NAMED_SPECIAL_TOKENS a model has to their text; they become special tokens of
    the backend if they are not yet. `add_bos`/`add_eos` set whether `encode` adds BOS/EOS; None keeps
    what the backend's post-processor does (and adds neither if it has none). `eos_ids` are more ids
    that end generation besides the EOS token's; `source` names the files in error messages.
    """

    def __init__(
        self,
        backend: Backend,
        *,
        special: dict[str, str | None] | None = None,
        add_bos: bool | None = None,
        add_eos: bool | None = None,
        eos_ids: Iterable[int] = (),
        chat_template: str | None = None,
        source: str = "this tokenizer",
    ):
        self.backend = backend
        self.source = source
        self.chat_template = chat_template
        self.special_tokens = {name: text for name, text in (special or {}).items() if text is not None}
        added = {token.content for token in backend.get_added_tokens_decoder().values()}
        backend.add_special_tokens(
            [
                AddedToken(text, special=True, normalized=False)
                for text in self.special_tokens.values()
                if text not in added
            ]
        )
        self.bos_id = self.token_to_id(self.special_tokens.get("bos_token"))
        eos_id = self.token_to_id(self.special_tokens.get("eos_token"))
        self.eos_ids = frozenset({*eos_ids, *([eos_id] if eos_id is not None else [])})
        if add_bos is not None or add_eos is not None or backend.post_processor is None:
            self._set_post_processor(
                bool(add_bos and self.bos_id is not None), bool(add_eos and eos_id is not None)
            )
        self._special_ids = frozenset(i for i, t in backend.get_added_tokens_decoder().items() if t.special)
        # Byte-fallback tokens; the decoder joins a run of them into characters only when the run ends.
        byte_ids = (backend.token_to_id(f"<0x{b:02X}>") for b in range(256))
        self.byte_fallback_ids = frozenset(i for i in byte_ids if i is not None)

    @classmethod
    def from_hf_dir(cls, directory: str | Path) -> Tokenizer:
        """The tokenizer of a Hugging Face checkpoint directory: tokenizer.json, with
        tokenizer_config.json (special tokens, chat_template), chat_template.jinja and
        generation_config.json (more EOS ids) where present.

        As in transformers 5, tokenizer.json's post-processor alone decides whether encode adds
        BOS/EOS; tokenizer_config.json's add_bos_token/add_eos_token are not read. Its normalizer,
        pre-tokenizer and decoder are used as written (transformers 5 rebuilds them for tokenizer
        classes such as LlamaTokenizer, which changes legacy SentencePiece files like Mixtral's on
        text that starts with a space)."""
        directory = Path(directory)
        path = directory / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(
                f"{directory} has no tokenizer.json; moerun reads tokenizers in that format only (a "
                "sentencepiece tokenizer.model alone is not enough: `transformers` can convert it, "
                "`AutoTokenizer.from_pretrained(dir).save_pretrained(dir)`)."
            )
        try:
            backend = Backend.from_file(str(path))
        except Exception as err:  # the tokenizers library raises a plain Exception
            raise TokenizerError(
                f"{path}: the tokenizers library cannot read it ({shorten(str(err), 150)})."
            ) from None
        config = _read_json(directory / "tokenizer_config.json")
        generation = _read_json(directory / "generation_config.json")

        # Tokens the config declares (transformers adds them to the backend if it lacks them).
        declared = _declared_tokens(config, directory / "tokenizer_config.json")
        extra = config.get("extra_special_tokens") or config.get("additional_special_tokens") or []
        if isinstance(extra, dict):
            extra = list(extra.values())
        extra = [_token_text(t) for t in extra] if isinstance(extra, list) else []
        declared += [AddedToken(t, special=True, normalized=False) for t in extra if t is not None]
        present = {token.content for token in backend.get_added_tokens_decoder().values()}
        backend.add_tokens([t for t in declared if t.content not in present and not t.special])
        backend.add_special_tokens([t for t in declared if t.content not in present and t.special])

        special = {name: _token_text(config.get(name)) for name in NAMED_SPECIAL_TOKENS}
        eos_ids = generation.get("eos_token_id")
        eos_ids = [] if eos_ids is None else eos_ids if isinstance(eos_ids, list) else [eos_ids]
        if not all(type(i) is int and 0 <= i < 2**31 for i in eos_ids):
            where, found = directory / "generation_config.json", quote(generation["eos_token_id"])
            raise TokenizerError(f"{where}: eos_token_id is {found}, not a token id or a list of them.")
        template_file = directory / "chat_template.jinja"
        template = config.get("chat_template")
        if template_file.is_file():
            template = template_file.read_text(encoding="utf-8")
        elif isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        if template is not None and not isinstance(template, str):
            raise TokenizerError(
                f"{directory / 'tokenizer_config.json'}: chat_template is {quote(template)}, not a template."
            )
        return cls(backend, special=special, eos_ids=eos_ids, chat_template=template, source=str(directory))

    @classmethod
    def from_gguf_metadata(cls, metadata: dict, source: str = "the GGUF file") -> Tokenizer:
        """The tokenizer a GGUF file's metadata describes (`moerun.text.gguf_vocab`). Raises
        ValueError naming the tokenizer kind or pre-tokenizer if it is not one moerun rebuilds."""
        try:
            vocab = read_gguf_vocab(metadata)
        except Exception as e:  # the vocabulary's arrays are the file's, of any type and length
            detail = str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
            raise TokenizerError(
                f"{source}: the GGUF vocabulary cannot be rebuilt: {shorten(detail, 200)}"
            ) from e
        return cls(
            vocab.backend,
            special={
                "bos_token": vocab.bos_token,
                "eos_token": vocab.eos_token,
                "unk_token": vocab.unk_token,
                "pad_token": vocab.pad_token,
            },
            add_bos=vocab.add_bos,
            add_eos=vocab.add_eos,
            eos_ids=vocab.eos_ids,
            chat_template=vocab.chat_template,
            source=source,
        )

    @property
    def vocab_size(self) -> int:
        """Ids run from 0 to vocab_size - 1 (added tokens included)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The ids of `text`; with `add_special_tokens`, BOS/EOS as the model's config asks."""
        # encode_batch, not encode: the same ids, and it lets other threads run while it works (a
        # server's event loop while a long prompt is tokenised in a thread); encode holds the GIL
        return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """The text of `ids`; special tokens (BOS, EOS, chat markers) left out unless asked for."""
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def is_special(self, token_id: int) -> bool:
        """Whether `token_id` is a special token: one that decode leaves out by default."""
        return int(token_id) in self._special_ids

    def token_to_id(self, text: str | None) -> int | None:
        return None if text is None else self.backend.token_to_id(text)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(int(token_id))

    def render_chat(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        **extra,
    ) -> str:
        """The model's chat prompt for `messages` (see `moerun.text.chat_template.render_chat`), with
        this tokenizer's special tokens, and `tools` and the calls in `messages` in the forms the
        template takes (`moerun.text.chat_tools`); ChatTemplateError if the model has no template."""
        if self.chat_template is None:
            raise no_template_error(self.source)
        return render_conversation(
            self.chat_template,
            messages,
            add_generation_prompt,
            tools,
            source=f"the chat template of {self.source}",
            **{**self.special_tokens, **extra},
        )

    def encode_chat(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        **extra,
    ) -> list[int]:
        """The ids of the chat prompt, as transformers' `apply_chat_template(tokenize=True)` gives them."""
        return self.encode(
            self.render_chat(messages, add_generation_prompt, tools, **extra), add_special_tokens=False
        )

    def _set_post_processor(self, add_bos: bool, add_eos: bool) -> None:
        # What transformers' `update_post_processor` writes, so the ids match to the last one.
        bos, eos = self.special_tokens.get("bos_token"), self.special_tokens.get("eos_token")
        single = " ".join([*([f"{bos}:0"] if add_bos else []), "$A:0", *([f"{eos}:0"] if add_eos else [])])
        pair = " ".join(
            [single, *([f"{bos}:1"] if add_bos else []), "$B:1", *([f"{eos}:1"] if add_eos else [])]
        )
        tokens = [
            *([(bos, self.bos_id)] if add_bos else []),
            *([(eos, self.token_to_id(eos))] if add_eos else []),
        ]
        self.backend.post_processor = processors.TemplateProcessing(
            single=single, pair=pair, special_tokens=tokens
        )

    def __repr__(self) -> str:
        eos = sorted(self.eos_ids)
        return f"Tokenizer({self.source}, vocab_size={self.vocab_size}, bos_id={self.bos_id}, eos_ids={eos})"


class StreamDecoder:
    """Text of generated ids as they arrive: `push(id)` returns the text that id completes (often
    "", e.g. for half a UTF-8 character), `flush()` what is left at the end. All pushes and the flush
    together equal `tokenizer.decode(all ids)`.

    It decodes a window of ids (the last emitted piece and what came after) and emits only the text
    past the piece's own, so context-dependent decoding (SentencePiece's leading space) comes out
    right. It holds back while that text ends in U+FFFD (bytes of a character still to come) and,
    for byte-fallback vocabularies, while the ids end in a `<0xNN>` token: a run of those is decoded
    as a whole, and one invalid byte at its end turns every byte of the run into U+FFFD.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self._start = 0  # the window: ids[_start:] ...
        self._emitted = 0  # ... of which ids[_start:_emitted] are already out, as _emitted_text
        self._emitted_text = ""

    def push(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        return "" if self._byte_run_open() else self._emit(final=False)

    def flush(self) -> str:
        return self._emit(final=True) if len(self.ids) > self._emitted else ""

    def _emit(self, final: bool) -> str:
        text = self.tokenizer.decode(self.ids[self._start :], self.skip_special_tokens)
        if len(text) <= len(self._emitted_text) or (not final and text.endswith(_REPLACEMENT)):
            return ""
        new = text[len(self._emitted_text) :]
        self._start, self._emitted = self._emitted, len(self.ids)
        self._emitted_text = self.tokenizer.decode(self.ids[self._start :], self.skip_special_tokens)
        return new

    def _byte_run_open(self) -> bool:
        """Whether the last id that decodes to something is a byte-fallback token."""
        byte_ids = self.tokenizer.byte_fallback_ids
        if not byte_ids:
            return False
        for token_id in reversed(self.ids[self._start :]):
            if not (self.skip_special_tokens and self.tokenizer.is_special(token_id)):
                return token_id in byte_ids
        return False


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json writes it: its text, or a dict with "content"."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict:
    return read_json(path, dict, TokenizerError) if path.is_file() else {}


def _declared_tokens(config: dict, path: Path) -> list[AddedToken]:
    """The tokens tokenizer_config.json's `added_tokens_decoder` declares, in id order."""
    table = config.get("added_tokens_decoder") or {}
    if not isinstance(table, dict):
        raise TokenizerError(f"{path}: added_tokens_decoder is {quote(table)}, not an object.")
    tokens = []
    for key, entry in table.items():
        if not key.isdigit() or not isinstance(entry, dict) or not isinstance(entry.get("content"), str):
            raise TokenizerError(
                f"{path}: added_tokens_decoder entry {quote(key)} is {quote(entry)}, not an id and an "
                'object with a "content" string.'
            )
        flags = {f: entry.get(f) for f in ("single_word", "lstrip", "rstrip", "normalized", "special")}
        if not all(v is None or isinstance(v, bool) for v in flags.values()):
            raise TokenizerError(f"{path}: added_tokens_decoder entry {quote(key)} has flags {quote(flags)}.")
        special = bool(flags["special"])
        token = AddedToken(
            entry["content"],
            single_word=bool(flags["single_word"]),
            lstrip=bool(flags["lstrip"]),
            rstrip=bool(flags["rstrip"]),
            normalized=not special if flags["normalized"] is None else flags["normalized"],
            special=special,
        )
        tokens.append((int(key), token))
    return [token for _, token in sorted(tokens, key=lambda kv: kv[0])]
