"""Tiny tokenizers trained on a few lines (no download), saved as Hugging Face tokenizer files:
byte-level BPE with GPT-2's, Qwen2's and Llama-3's word splitting, and SentencePiece-style BPE (`▁`
for spaces, `<0xNN>` byte fallback) in the current and the legacy (Mixtral's) spelling."""

from __future__ import annotations

import json
import random
from pathlib import Path

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors, trainers
from tokenizers import Tokenizer as Backend

from moerun.text import Tokenizer

CORPUS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "Café crème brûlée, naïve résumé, déjà vu.",
    "日本語のテキストです。東京は日本の首都です。",
    "Emoji: 😀 😃 🎉 and more 🎉🎉 party",
    "def f(x):\n    return x * 2  # double it\n",
    "It's 2024; we're 100% sure they'll win 3-1. I'd say so.",
    "  leading spaces and\ttabs\n\nnewlines  ",
    "The theory of the thing is that there is nothing there.",
] * 4

# Characters to build random text from: some in the training text, some not (so byte fallback and
# byte-level pieces are needed), and the special tokens' text.
PIECES = [
    *"abcdefghijklmnopqrstuvwxyz ABCXYZ 0123456789 .,;:!?'\"()-\n\t",
    *"éèàüñçØ€Ω日本語東京中文한국어😀🎉🙂👍🏽",
    " the",
    "  ",
    "<s>",
    "</s>",
    "<|im_end|>",
    "<|endoftext|>",
    "<think>",
    "<sep>",
]
STRINGS = [
    "",
    " ",
    "Hello world",
    " Hello",
    "  two spaces",
    "héllo wörld €5 Ω",
    "日本語 中文 한국어",
    "🙂🎉x 👍🏽",
    "<s>Hi</s> there",
    "a<|im_end|>b <think> c",
    "line1\nline2\r\n\tx",
    "It's 'quoted' 12345678",
    "<sep>x",
    "<unk>",
    "naïve<|endoftext|>",
]

QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def byte_level_tokenizer(split: str = "gpt2", extra_special: tuple[str, ...] = ()) -> Backend:
    """Byte-level BPE as GPT-2 ("gpt2"), Qwen2 ("qwen2") or Llama 3 ("llama3", adds BOS) write it."""
    tok = Backend(models.BPE(continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False))
    if split == "gpt2":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        regex = {"qwen2": QWEN2_SPLIT, "llama3": LLAMA3_SPLIT}[split]
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(regex), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    if split == "llama3":
        specials.insert(0, "<|begin_of_text|>")
    trainer = trainers.BpeTrainer(
        vocab_size=420,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in extra_special])
    tok.add_tokens([AddedToken("<think>", normalized=False, special=False)])
    if split == "llama3":
        bos = tok.token_to_id("<|begin_of_text|>")
        tok.post_processor = processors.TemplateProcessing(
            single="<|begin_of_text|> $A",
            pair="<|begin_of_text|> $A <|begin_of_text|> $B",
            special_tokens=[("<|begin_of_text|>", bos)],
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def sentencepiece_tokenizer(legacy: bool = False) -> Backend:
    """SentencePiece-style BPE as Llama 2 writes it: <unk> <s> </s>, then the 256 `<0xNN>` byte
    tokens, then the pieces; `▁` put before the text by a Metaspace pre-tokenizer, or (`legacy`,
    as Mixtral's file has it) by a normalizer; encode adds <s>."""
    trainer_tok = Backend(models.BPE())
    trainer_tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    trainer_tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=260, show_progress=False))
    trained = json.loads(trainer_tok.to_str())["model"]
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))]
    tokens += [t for t, _ in sorted(trained["vocab"].items(), key=lambda kv: kv[1]) if t not in tokens]
    tok = Backend(
        models.BPE(
            vocab={t: i for i, t in enumerate(tokens)},
            merges=[tuple(m) for m in trained["merges"]],
            unk_token="<unk>",
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    if legacy:
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in ("<unk>", "<s>", "</s>")])
    tok.add_tokens([AddedToken("<sep>", normalized=False, special=False)])
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    return tok


def save_hf_dir(tok: Backend, directory: Path, generation_config: dict | None = None, **config) -> Path:
    """tokenizer.json and tokenizer_config.json (`config`), as a checkpoint directory holds them."""
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False))
    if generation_config is not None:
        (directory / "generation_config.json").write_text(json.dumps(generation_config))
    return directory


SPM_CONFIG = dict(
    bos_token="<s>", eos_token="</s>", unk_token="<unk>", add_bos_token=True, add_eos_token=False
)
# name -> (tokenizer, tokenizer_config.json); the class each config names is one whose own pipeline
# equals the file's (transformers 5 rebuilds a LlamaTokenizer's from its vocabulary).
VARIANTS = {
    "gpt2": (
        lambda: byte_level_tokenizer("gpt2"),
        dict(bos_token="<|endoftext|>", eos_token="<|endoftext|>", unk_token="<|endoftext|>"),
    ),
    "qwen2": (
        lambda: byte_level_tokenizer("qwen2"),
        dict(
            tokenizer_class="Qwen2Tokenizer",
            bos_token=None,
            eos_token="<|im_end|>",
            pad_token="<|endoftext|>",
        ),
    ),
    "llama3": (
        lambda: byte_level_tokenizer("llama3"),
        dict(
            tokenizer_class="PreTrainedTokenizerFast",
            bos_token="<|begin_of_text|>",
            eos_token="<|endoftext|>",
        ),
    ),
    "spm": (sentencepiece_tokenizer, dict(tokenizer_class="LlamaTokenizer", **SPM_CONFIG)),
    "spm-legacy": (
        lambda: sentencepiece_tokenizer(legacy=True),
        dict(tokenizer_class="PreTrainedTokenizerFast", **SPM_CONFIG),
    ),
}


# GGUF token types (llama.cpp's)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, BYTE = 1, 2, 3, 4, 6


def token_types(tok: Backend, kind: str) -> list[int]:
    added = {t.content: t.special for t in tok.get_added_tokens_decoder().values()}
    types = []
    for text in vocab_tokens(tok):
        if text == "<unk>":
            types.append(UNKNOWN)
        elif text in added:
            types.append(CONTROL if added[text] else USER_DEFINED)
        elif kind == "llama" and text.startswith("<0x") and len(text) == 6:
            types.append(BYTE)
        else:
            types.append(NORMAL)
    return types


def vocab_tokens(tok: Backend) -> list[str]:
    return [text for text, _ in sorted(tok.get_vocab().items(), key=lambda kv: kv[1])]


def add_gguf_vocab(
    writer,
    tok: Backend,
    kind: str,
    pre: str | None = None,
    merges: bool = True,
    scores: bool = True,
    chat_template: str | None = None,
    **keys,
) -> None:
    """`tok`'s vocabulary as llama.cpp's converter writes it, into a gguf.GGUFWriter: kind
    ("llama" or "gpt2"), tokens, types, scores, merges; `keys` are GGUFWriter.add_<key> calls,
    e.g. bos_token_id=1, add_bos_token=True."""
    model = json.loads(tok.to_str())["model"]
    tokens = vocab_tokens(tok)
    writer.add_tokenizer_model(kind)
    if pre is not None:
        writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(token_types(tok, kind))
    if scores:
        # A merged piece scores by its merge's rank (earlier is better), single characters lowest.
        rank = {a + b: i for i, (a, b) in enumerate(model["merges"])}
        writer.add_token_scores([-float(rank.get(t, 1e6)) for t in tokens])
    if merges:
        writer.add_token_merges([" ".join(m) for m in model["merges"]])
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    for key, value in keys.items():
        getattr(writer, f"add_{key}")(value)


def random_text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(PIECES) for _ in range(rng.randrange(n)))


def random_ids(rng: random.Random, tokenizer: Tokenizer, n: int) -> list[int]:
    """Random ids, half of them byte-fallback tokens where the vocabulary has them (lone bytes, and
    runs that may or may not make whole characters)."""
    byte_ids = sorted(tokenizer.byte_fallback_ids)
    return [
        rng.choice(byte_ids) if byte_ids and rng.random() < 0.5 else rng.randrange(tokenizer.vocab_size)
        for _ in range(rng.randrange(1, n))
    ]


# A ChatML template (the Qwen family's), with a default system message.
CHATML = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are helpful.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
