"""A made-up byte-level vocabulary of any size, shaped like Qwen's or OLMoE's (no download): what a
benchmark needs where the cost depends on the vocabulary's width and contents, as a grammar engine's
token masks do. No merges: encoding gives single bytes, so prompts are given as ids; decoding and
the grammar engine's view of each token are as a trained tokenizer's."""

from __future__ import annotations

import random

from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as Backend

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def synthetic_vocab(size: int, seed: int = 0) -> Backend:
    """A byte-level BPE vocabulary of `size` ids: the 256 byte tokens, then words with and without a
    leading space, digit runs, punctuation runs and CJK characters, then SPECIALS (the last ids)."""
    if size < 256 + len(SPECIALS):
        raise ValueError(f"a byte-level vocabulary needs at least {256 + len(SPECIALS)} ids, not {size}.")
    rng = random.Random(seed)
    visible = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    byte_char = {b: chr(b) for b in visible}
    byte_char.update({b: chr(256 + i) for i, b in enumerate(b for b in range(256) if b not in byte_char)})

    def spell(text: str) -> str:
        return "".join(byte_char[b] for b in text.encode())

    vocab = {byte_char[b]: i for i, b in enumerate(range(256))}
    letters, punct = "etaoinshrdlcumwfgypbvkjxqz", list("{}[]()\":,.;!?-_=+*/\\'<>#@$%^&|~` \n")
    while len(vocab) < size - len(SPECIALS):
        r = rng.random()
        if r < 0.55:
            text = " " + "".join(rng.choice(letters) for _ in range(rng.randint(1, 10)))
        elif r < 0.8:
            text = "".join(rng.choice(letters) for _ in range(rng.randint(2, 10)))
        elif r < 0.85:
            text = "".join(rng.choice("0123456789") for _ in range(rng.randint(1, 3)))
        elif r < 0.93:
            text = "".join(rng.choice(punct) for _ in range(rng.randint(1, 4)))
        else:
            text = "".join(chr(rng.randint(0x4E00, 0x9FFF)) for _ in range(rng.randint(1, 2)))
        vocab.setdefault(spell(text), len(vocab))
    for s in SPECIALS:
        vocab[s] = len(vocab)
    tok = Backend(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True) for s in SPECIALS])
    return tok


def synthetic_tokenizer(size: int, seed: int = 0):
    """synthetic_vocab as moerun's Tokenizer, <|endoftext|> its end of sequence."""
    from moerun.text.tokenizer import Tokenizer

    backend = synthetic_vocab(size, seed)
    return Tokenizer(backend, special={"eos_token": SPECIALS[0]}, source=f"a made-up {size}-id vocabulary")
