"""Text in, text out: tokenizers read from a checkpoint's tokenizer.json or rebuilt from GGUF metadata
(`tokenizer`, `gguf_vocab`), streaming decode of generated ids, and chat templates rendered as
transformers renders them (`chat_template`). Runtime dependencies: `tokenizers` and `jinja2`."""

from moerun.text.chat_template import ChatTemplateError, render_chat
from moerun.text.gguf_vocab import read_gguf_vocab
from moerun.text.tokenizer import StreamDecoder, Tokenizer

__all__ = ["ChatTemplateError", "StreamDecoder", "Tokenizer", "read_gguf_vocab", "render_chat"]
