"""Structured output from Python and the command line: a random tiny model (with a trained tiny
tokenizer) under a JSON schema, JSON object or grammar writes text that parses and validates
(checked with `jsonschema` and `json`, not with the grammar engine that made the masks); the mask
composes with sampling, penalties and logprobs; constrained and unconstrained sequences share a
batch without one's mask reaching the other; what the engine cannot enforce is refused, named."""

import itertools
import json
import math
import sys

import pytest
import torch
from hf_models import chatml_checkpoint

import moerun
from moerun import Grammar, GrammarError
from moerun.batching import Batch, Request
from moerun.cli.main import main
from moerun.text.grammar import lark_json

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

# Schemas whose every valid text is short, so a random model ends them well within the budget.
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 4},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 2},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
    "additionalProperties": False,
}
SHAPE = {
    "anyOf": [
        {
            "type": "object",
            "properties": {"kind": {"const": "circle"}, "r": {"type": "integer", "minimum": 1, "maximum": 9}},
            "required": ["kind", "r"],
            "additionalProperties": False,
        },
        {
            "type": "object",
            "properties": {"kind": {"const": "square"}, "side": {"type": "number", "maximum": 99}},
            "required": ["kind", "side"],
            "additionalProperties": False,
        },
    ]
}
NUMBERS = {
    "type": "array",
    "items": {"type": "integer", "minimum": -5, "maximum": 5},
    "maxItems": 3,
}
WORD = {"type": "string", "pattern": "^[a-c]{2,5}$"}
SCHEMAS = {"person": PERSON, "shape": SHAPE, "numbers": NUMBERS, "word": WORD}
BUDGET = 120  # tokens: more than the longest text any of these schemas allows


def schema_format(schema: dict, name: str = "s") -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return chatml_checkpoint(tmp_path_factory.mktemp("structured"))


@pytest.fixture(scope="module")
def model(checkpoint):
    return moerun.load(checkpoint, dtype=torch.float32)


def _text(tokens) -> str:
    return "".join(t.text for t in tokens)


@pytest.mark.parametrize("name", SCHEMAS)
def test_sampled_output_under_a_schema_parses_and_validates(model, name):
    schema = SCHEMAS[name]
    for seed in range(2):
        fmt = schema_format(schema)
        tokens = list(model.generate("hello", BUDGET, temperature=1.0, seed=seed, response_format=fmt))
        assert model.stats()["finish_reason"] == "stop", _text(tokens)
        jsonschema.validate(json.loads(_text(tokens)), schema)


def test_the_mask_composes_with_sampling_filters_penalties_and_logprobs(model):
    options = dict(
        temperature=0.8,
        top_k=40,
        top_p=0.9,
        min_p=0.02,
        repetition_penalty=1.3,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        logprobs=3,
    )
    for seed, schema in enumerate([PERSON, SHAPE]):
        fmt = schema_format(schema)
        tokens = list(model.generate("hi", BUDGET, seed=seed, response_format=fmt, **options))
        jsonschema.validate(json.loads(_text(tokens)), schema)
        for t in tokens:  # the mask came first: no alternative the grammar forbids is listed
            assert math.isfinite(t.logprob) and all(math.isfinite(lp) for _, lp in t.top_logprobs)


def test_forced_text_has_probability_one(model):
    """Under a `const` schema only one token may come at each step: its log-probability, taken after
    the mask, is 0 and it is the only alternative."""
    fmt = schema_format({"const": "hello world"})
    tokens = list(model.generate("x", 40, temperature=1.0, seed=0, logprobs=5, response_format=fmt))
    assert _text(tokens) == '"hello world"' and model.stats()["finish_reason"] == "stop"
    for t in tokens:
        assert abs(t.logprob) < 1e-5 and len(t.top_logprobs) == 1 and t.top_logprobs[0][0] == t.id


def test_greedy_under_a_schema_validates(model):
    for schema in (PERSON, WORD):
        text = _text(
            model.generate("The quick", BUDGET, temperature=0, response_format=schema_format(schema))
        )
        jsonschema.validate(json.loads(text), schema)


def test_an_end_of_sequence_id_ends_only_complete_text(model):
    """An integer may stop after any digit (the end id is allowed there) but not before the first:
    whatever the seed, the text is a whole integer in range."""
    schema = {"type": "integer", "minimum": 0, "maximum": 10**9}
    for seed in range(3):
        fmt = schema_format(schema)
        tokens = list(model.generate("n =", 40, temperature=1.5, seed=seed, response_format=fmt))
        text = _text(tokens)
        assert model.stats()["finish_reason"] == "stop" and 0 <= int(text) <= 10**9, text


def _completable(text: str) -> bool:
    """Whether `text` is the beginning of some JSON object: it is closed by one of a few endings
    (finish a string, an escape, a literal, a number, a key's value) and its open brackets."""
    stack, in_string, escaped = [], False, False
    for ch in text:
        if in_string:
            escaped = not escaped and ch == "\\"
            in_string = escaped or ch != '"'
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            stack.append("}" if ch == "{" else "]")
        elif ch in "}]":
            stack.pop()
    closers = "".join(reversed(stack))
    heads = ['"', 'n"', '0"', '00"', '000"', '0000"'] if in_string else [""]
    middles = ["", "0", " 0", ": 0", '"": 0', ' "": 0']  # a number's digit, a value, a key and value
    middles += ["ue", "rue", "alse", "lse", "se", "e", "ull", "ll", "l"]  # the rest of a literal
    for head, middle in itertools.product(heads, middles):
        try:
            value = json.loads(text + head + middle + closers)
        except ValueError:
            continue
        if isinstance(value, dict):
            return True
    return False


def test_json_object_output_is_a_json_object_or_its_beginning(model):
    """A random model rarely closes a string, so `json_object` text mostly ends at the budget; what
    it wrote must then still begin a JSON object (and parse as one where it stopped)."""
    assert _completable('{"a": [1, "x\\') and not _completable('{"a" 1')  # the checker itself
    for seed in range(2):
        fmt = {"type": "json_object"}
        tokens = list(model.generate("hi", 24, temperature=1.0, seed=seed, response_format=fmt))
        text = _text(tokens)
        if model.stats()["finish_reason"] == "stop":
            assert isinstance(json.loads(text), dict)
        else:
            assert model.stats()["finish_reason"] == "length" and _completable(text), text


def test_constrained_and_free_sequences_share_a_batch(model):
    """One batch of a greedy free prompt and two constrained sampled ones: each gets the tokens it
    gets alone (no mask reaches another's row, each matcher keeps its own place)."""
    prompts = ["The quick brown", "hello", "hi there"]
    schemas = [None, NUMBERS, SHAPE]
    requests = [
        Request.make(model, p, 12)
        if schema is None
        else Request.make(model, p, BUDGET, temperature=0.9, seed=i, response_format=schema_format(schema))
        for i, (p, schema) in enumerate(zip(prompts, schemas, strict=True))
    ]
    alone = [_run(model, [r])[0] for r in requests]
    together = _run(model, requests)
    assert together == alone
    for tokens, schema in zip(together[1:], schemas[1:], strict=True):
        jsonschema.validate(json.loads(model.tokenizer.decode(tokens)), schema)


def _run(model, requests) -> list[list[int]]:
    """Each request's token ids, all run in one Batch."""
    batch = Batch(model)
    sequences = [batch.add(r) for r in requests]
    ids = {id(s): [] for s in sequences}
    while batch.running:
        for s, tokens in batch.step():
            ids[id(s)] += [t.id for t in tokens]
    return [ids[id(s)] for s in sequences]


def test_a_literal_spelling_a_special_token_is_written_as_text(model):
    """A grammar or schema whose text spells a special token ("<|im_end|>", the end id's) gets that
    text from ordinary tokens: the special ids never come (the end id would cut the JSON short, and
    the engine would refuse <|im_start|>'s id as not being the text)."""
    special = {model.tokenizer.token_to_id(t) for t in ("<|im_start|>", "<|im_end|>", "<|endoftext|>")}
    cases = [
        (Grammar.text('start: "<|im_start|>" "x"'), "<|im_start|>x"),
        (schema_format({"const": "<|im_end|>"}), '"<|im_end|>"'),
        (schema_format({"type": "string", "pattern": "^<\\|im_end\\|>!$"}), '"<|im_end|>!"'),
    ]
    for fmt, text in cases:
        for seed in range(2):
            tokens = list(model.generate("hi", 30, temperature=1.0, seed=seed, response_format=fmt))
            assert _text(tokens) == text and model.stats()["finish_reason"] == "stop"
            assert not special & {t.id for t in tokens}


def test_a_grammar_that_breaks_down_ends_only_its_own_sequence(model, monkeypatch):
    """Where the engine refuses a token its own mask allowed, that sequence ends with finish_reason
    "error" (generate raises GrammarError), and the others in the batch go on as if alone."""
    from moerun.text.grammar import Matcher

    def refuse(self, token_id):
        raise GrammarError(f"{self.source} broke down at token {token_id}: refused")

    monkeypatch.setattr(Matcher, "advance", refuse)
    broken = Grammar.text('start: "yes" | "no"')
    with pytest.raises(GrammarError, match="broke down at token"):
        list(model.generate("hi", 6, response_format=broken))
    batch = Batch(model)
    free = batch.add(Request.make(model, "The quick brown", 6))
    failed = batch.add(Request.make(model, "hi", 6, response_format=broken))
    ids = []
    while batch.running:
        ids += [t.id for s, tokens in batch.step() if s is free for t in tokens]
    assert failed.stats["finish_reason"] == "error" and "broke down" in failed.stats["error"]
    assert ids == [t.id for t in model.generate("The quick brown", 6)]


def test_a_grammar_in_gbnf_or_lark(model):
    gbnf = 'root ::= "yes" | "no" | "maybe " [0-9]'
    lark = 'start: "yes" | "no" | "maybe " /[0-9]/'
    for text in (gbnf, lark):
        for seed in range(3):
            fmt = Grammar.text(text)
            out = _text(model.generate("?", 20, temperature=1.0, seed=seed, response_format=fmt))
            assert out in ("yes", "no") or (out[:6] == "maybe " and out[6:].isdigit() and len(out) == 7), out


def test_json_inside_a_grammar(model):
    """JSON under a schema inside other text (as a tool call wraps its arguments): the text between
    the markers validates."""
    grammar = Grammar.text('start: "<call>" args "</call>"\nargs: ' + lark_json(NUMBERS))
    for seed in range(2):
        text = _text(model.generate("?", BUDGET, temperature=1.0, seed=seed, response_format=grammar))
        assert text.startswith("<call>") and text.endswith("</call>"), text
        jsonschema.validate(json.loads(text[len("<call>") : -len("</call>")]), NUMBERS)


def test_what_cannot_be_enforced_is_refused_by_name(model):
    cases = {
        '"not"': {"not": {"type": "string"}},
        '"uniqueItems"': {"type": "array", "uniqueItems": True},
        "banana": {"type": "banana"},
        "unclosed group": {"type": "string", "pattern": "("},
    }
    for named, schema in cases.items():
        with pytest.raises(GrammarError, match=named):
            model.generate("x", 4, response_format=schema_format(schema))
    with pytest.raises(GrammarError, match="response_format.type"):
        model.generate("x", 4, response_format={"type": "xml"})
    with pytest.raises(GrammarError, match="neither Lark nor GBNF"):
        Grammar.text("root ::= (")


def test_without_the_engine_a_format_says_what_to_install(model, monkeypatch):
    monkeypatch.setitem(sys.modules, "llguidance", None)  # `import llguidance` fails
    with pytest.raises(GrammarError, match=r"pip install 'moerun\[structured\]'"):
        model.generate("x", 4, response_format={"type": "json_object"})
    assert len(list(model.generate("x", 4, response_format={"type": "text"}))) == 4


def test_generate_json_schema_and_grammar_flags(checkpoint, capsys, tmp_path):
    schema_file = tmp_path / "person.json"
    schema_file.write_text(json.dumps(PERSON))
    base = ["generate", "-m", str(checkpoint), "-p", "hello", "--dtype", "fp32", "-n", str(BUDGET)]
    sampled = ["--temperature", "1", "--seed", "4", "--json"]
    assert main([*base, *sampled, "--json-schema", str(schema_file)]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["finish_reason"] == "stop"
    jsonschema.validate(json.loads(record["text"]), PERSON)

    grammar_file = tmp_path / "answer.gbnf"
    grammar_file.write_text('root ::= "yes" | "no"\n')
    assert main([*base, *sampled, "--grammar", str(grammar_file)]) == 0
    assert json.loads(capsys.readouterr().out)["text"] in ("yes", "no")

    grammar_file.write_text("root ::= (\n")
    assert main([*base, "--grammar", str(grammar_file)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"moerun generate: --grammar {grammar_file} is neither")
    schema_file.write_text('{"not": {}}')
    assert main([*base, "--json-schema", str(schema_file)]) == 2
    assert '"not"' in capsys.readouterr().err


def test_arguments_as_key_value_pairs_are_held_to_their_schema(model):
    """A call whose arguments are GLM-4.5's <arg_key>/<arg_value> pairs, under the grammar of one
    call: read back by GLM's own reader (moerun.text.tool_calls.TaggedCalls), the arguments
    validate, string lengths included (counted after the reader strips the value)."""
    from moerun.text.chat_tools import ArgumentPairs, CallForm
    from moerun.text.grammar import tool_call_grammar
    from moerun.text.tool_calls import TaggedCalls

    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "minLength": 2, "maxLength": 5},
            "note": {"type": "string", "maxLength": 1},
            "n": {"type": "integer", "minimum": 1, "maximum": 9},
            "mode": {"type": "string", "enum": ["fast", "slow"]},
        },
        "required": ["city", "n", "mode"],
    }
    pairs = ArgumentPairs("<arg_key>", "</arg_key>\n<arg_value>", "</arg_value>\n")
    call = tool_call_grammar([CallForm("<tool_call>f\n", schema, "</tool_call>", pairs)], model.tokenizer)
    for seed in range(6):
        text = _text(model.generate("hi", 240, temperature=1.0, seed=seed, response_format=call))
        assert model.stats()["finish_reason"] == "stop", text
        size, calls = TaggedCalls().region(text, True, {"f": schema})
        assert size == len(text) and calls is not None, text
        ((name, arguments),) = calls
        assert name == "f"
        jsonschema.validate(json.loads(arguments), schema)
