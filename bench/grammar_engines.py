"""The two grammar engines of the serving field on moerun's step: llguidance (llama.cpp's, the one
moerun uses) and xgrammar (vLLM's and SGLang's default). For a 421-token trained tokenizer (the
tests') and a 151936-token byte-level vocabulary (Qwen's size, made up here: no download), it times
what structured output costs: building the engine's view of the vocabulary, compiling a schema,
the mask per token while the text of one valid JSON document is fed token by token, and moerun's
own step under llguidance (moerun.text.grammar.fill_masks + apply_masks for 1 and 8 sequences at
once, on fp32 logits of the vocabulary's width; one torch thread). Each figure is the minimum of
`--repeats` runs.

    pip install llguidance xgrammar jsonschema
    PYTHONPATH=. python bench/grammar_engines.py [--repeats 5]

It also lists which JSON-schema keywords each engine refuses (a refusal names the keyword) and
which it accepts and ignores (output that may not validate)."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer

from moerun.benchmarks.vocabulary import synthetic_vocab

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.[a-z]{2,3}$"},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 5},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "score": {"type": "number"},
    },
    "required": ["name", "age", "email", "tags", "address", "score"],
    "additionalProperties": False,
}
DOCUMENT = {
    "name": "Ada Lovelace the first programmer",
    "age": 36,
    "email": "ada@math.org",
    "tags": ["red", "blue", "green"],
    "address": {"city": "London town in the rain", "zip": "W1 2AB"},
    "score": 99.5,
}
KEYWORDS = {
    "not": {"not": {"type": "string"}},
    "if/then": {"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}},
    "uniqueItems": {"type": "array", "uniqueItems": True},
    "contains": {"type": "array", "contains": {"const": 3}},
    "dependentRequired": {"type": "object", "dependentRequired": {"a": ["b"]}},
    "propertyNames": {"type": "object", "propertyNames": {"pattern": "^a"}},
    "format: nonsense": {"type": "string", "format": "nonsense"},
}


def walk(llg, vocab, grammar: str, text: bytes, width: int) -> list[int]:
    """Token ids spelling `text`, each the longest token the grammar allows there (one valid
    sequence, fed to both engines)."""
    import llguidance.torch as llgt

    pieces = [vocab.decode_bytes([i]) for i in range(width)]
    matcher, mask = llg.LLMatcher(vocab, grammar), llgt.allocate_token_bitmask(1, width)
    ids, at = [], 0
    while at < len(text):
        llgt.fill_next_token_bitmask(matcher, mask)
        allowed = ((mask[0].unsqueeze(1) >> torch.arange(32, dtype=torch.int32)) & 1).flatten()[:width]
        fits = [
            i for i in allowed.nonzero().flatten().tolist() if pieces[i] and text.startswith(pieces[i], at)
        ]
        best = max(fits, key=lambda i: len(pieces[i]))
        ids.append(best)
        at += len(pieces[best])
        assert matcher.consume_token(best)
    return ids


def best_of(repeats: int, run) -> float:
    return min(run() for _ in range(repeats))


def timed(function) -> float:
    start = time.perf_counter()
    function()
    return time.perf_counter() - start


def measure(tok: Tokenizer, label: str, repeats: int) -> list[str]:
    import llguidance as llg
    import llguidance.torch as llgt
    import xgrammar as xgr

    from moerun.text.grammar import JSON_OPTIONS, JSON_OVERRIDES, Matcher, apply_masks, fill_masks

    width, eos, text = tok.get_vocab_size(), tok.token_to_id("<|im_end|>"), tok.to_str()
    lines = []
    start = time.perf_counter()
    vocab = llg.LLTokenizer(text, n_vocab=width, eos_token=eos)
    llg_vocab_s = time.perf_counter() - start
    encoded = [""] * width
    for piece, i in tok.get_vocab().items():
        encoded[i] = piece
    start = time.perf_counter()
    meta = xgr.TokenizerInfo._detect_metadata_from_hf(text)
    info = xgr.TokenizerInfo(
        encoded,
        meta["vocab_type"],
        vocab_size=width,
        stop_token_ids=[eos],
        add_prefix_space=meta["add_prefix_space"],
    )
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    xgr_vocab_s = time.perf_counter() - start
    views = f"llguidance {llg_vocab_s * 1e3:.0f} ms, xgrammar {xgr_vocab_s * 1e3:.0f} ms"
    lines.append(f"{label} ({width} ids): the engine's view of the vocabulary {views}")
    for case, schema in (("schema", SCHEMA), ("json_object", {"type": "object"})):
        document = json.dumps(DOCUMENT, separators=(", ", ": ")).encode()
        grammar = llg.LLMatcher.grammar_from_json_schema(schema, JSON_OPTIONS, JSON_OVERRIDES)
        ids = walk(llg, vocab, grammar, document, width)
        llg_compile = best_of(repeats, lambda g=grammar: timed(lambda: llg.LLMatcher(vocab, g)))

        def xgr_compile(schema=schema):
            return compiler.compile_json_schema(
                json.dumps(schema), any_whitespace=False, separators=(", ", ": ")
            )

        xgr_compile_s = best_of(repeats, lambda: timed(xgr_compile))
        compiled = xgr_compile()

        per_token: list[float] = []  # llguidance's seconds per token in its best run

        def llg_masks(grammar=grammar, ids=ids, per_token=per_token) -> float:
            matcher, mask, seconds = llg.LLMatcher(vocab, grammar), llgt.allocate_token_bitmask(1, width), []
            for i in ids:
                seconds.append(timed(lambda: llgt.fill_next_token_bitmask(matcher, mask)))
                matcher.consume_token(i)
            if not per_token or statistics.mean(seconds) < statistics.mean(per_token):
                per_token[:] = seconds
            return statistics.mean(seconds)

        def xgr_masks(compiled=compiled, ids=ids) -> float:
            matcher, mask, seconds = xgr.GrammarMatcher(compiled), xgr.allocate_token_bitmask(1, width), []
            for i in ids:
                seconds.append(timed(lambda: matcher.fill_next_token_bitmask(mask)))
                assert matcher.accept_token(i)
            return statistics.mean(seconds)

        def our_step(n: int, grammar=grammar, ids=ids) -> float:
            """moerun's step for n sequences at once, each fed the document: masks and logits."""
            matchers = [Matcher(llg.LLMatcher(vocab, grammar), "bench") for _ in range(n)]
            logits, seconds = torch.randn(n, width), []
            for i in ids:
                seconds.append(timed(lambda: apply_masks(logits, fill_masks(matchers, width))))
                for m in matchers:
                    m.advance(i)
            return statistics.mean(seconds)

        llg_mask, xgr_mask = best_of(repeats, llg_masks), best_of(repeats, xgr_masks)
        one, eight = best_of(repeats, lambda: our_step(1)), best_of(repeats, lambda: our_step(8))
        lines.append(
            f"  {case}, {len(ids)} tokens: compile llguidance {llg_compile * 1e3:.2f} ms, xgrammar "
            f"{xgr_compile_s * 1e3:.2f} ms; mask per token llguidance {llg_mask * 1e6:.0f} us (median "
            f"{statistics.median(per_token) * 1e6:.0f}, worst {max(per_token) * 1e6:.0f}), xgrammar "
            f"{xgr_mask * 1e6:.0f} us; moerun's step (llguidance masks + -inf added to the logits) "
            f"1 sequence {one * 1e6:.0f} us, 8 sequences {eight * 1e6:.0f} us"
        )
    return lines


def keywords(tok: Tokenizer) -> list[str]:
    import llguidance as llg
    import xgrammar as xgr

    vocab = llg.LLTokenizer(
        tok.to_str(), n_vocab=tok.get_vocab_size(), eos_token=tok.token_to_id("<|im_end|>")
    )
    encoded = [""] * tok.get_vocab_size()
    for piece, i in tok.get_vocab().items():
        encoded[i] = piece
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo(encoded, xgr.VocabType.BYTE_LEVEL))
    lines = ["keyword: llguidance / xgrammar"]
    for name, schema in KEYWORDS.items():
        matcher = llg.LLMatcher(vocab, llg.LLMatcher.grammar_from_json_schema(schema))
        ours = f"refused ({matcher.get_error()[:60]})" if matcher.is_error() else "accepted"
        try:
            compiler.compile_json_schema(json.dumps(schema))
            theirs = "accepted"
        except Exception as e:
            theirs = f"refused ({str(e).splitlines()[-1][:60]})"
        lines.append(f"  {name}: {ours} / {theirs}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    from tiny_tokenizers import byte_level_tokenizer

    torch.set_num_threads(1)
    tiny = byte_level_tokenizer("qwen2")
    for line in [
        *measure(tiny, "tiny", args.repeats),
        *measure(synthetic_vocab(151936), "synthetic", args.repeats),
    ]:
        print(line)
    for line in keywords(tiny):
        print(line)


if __name__ == "__main__":
    main()
