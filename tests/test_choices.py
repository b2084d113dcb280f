"""`n` choices of one prompt: choice i is what a request of its own with seed + i gives (same ids),
the prompt is prefilled once (the ids fed to the model are counted: the prompt once, then each
choice's tokens), and every choice under a grammar validates."""

import json

import pytest
import torch
from hf_models import chatml_checkpoint

import moerun


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = chatml_checkpoint(tmp_path_factory.mktemp("choices"))
    return moerun.load(path, dtype=torch.float32)


def _ids(tokens) -> list[int]:
    return [t.id for t in tokens]


def test_choice_i_is_a_request_with_seed_plus_i(model):
    options = dict(temperature=1.0, top_p=0.95, seed=11)
    choices = model.generate("The quick brown", 10, n=3, **options)
    assert len(choices) == 3
    alone = [_ids(model.generate("The quick brown", 10, **{**options, "seed": 11 + i})) for i in range(3)]
    assert [_ids(c) for c in choices] == alone
    assert len({tuple(a) for a in alone}) > 1  # other seeds, other texts: the check can fail
    assert "".join(t.text for t in choices[1]) == model.tokenizer.decode(alone[1])


def test_the_prompt_is_prefilled_once(model, monkeypatch):
    """Every id the model is fed, counted: the prompt once, then each choice's tokens but its last."""
    fed: list[int] = []
    forward = model.forward_sequences

    def counting(chunks, caches):
        fed.extend(len(c) for c in chunks)
        return forward(chunks, caches)

    monkeypatch.setattr(model, "forward_sequences", counting)
    prompt = model.tokenizer.encode("hello there, how are you")
    choices = model.generate(prompt, 6, n=4, temperature=1.0, seed=0)
    new = [len(c) for c in choices]
    assert sum(fed) == len(prompt) + sum(n - 1 for n in new)
    assert fed.count(len(prompt)) == 1 and max(fed[1:]) == 1  # one prefill, then one token each
    assert model.stats()["prompt_tokens"] == len(prompt)


def test_choices_under_a_schema_each_validate(model):
    pytest.importorskip("llguidance")
    jsonschema = pytest.importorskip("jsonschema")
    schema = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 3}
    fmt = {"type": "json_schema", "json_schema": {"name": "digits", "schema": schema}}
    choices = model.generate("hi", 40, n=3, temperature=1.0, seed=3, response_format=fmt)
    for i, choice in enumerate(choices):
        jsonschema.validate(json.loads("".join(t.text for t in choice)), schema)
        alone = model.generate("hi", 40, temperature=1.0, seed=3 + i, response_format=fmt)
        assert _ids(choice) == _ids(alone)


def test_n_is_checked(model):
    with pytest.raises(ValueError, match="n must be an integer >= 1"):
        model.generate("hi", 2, n=0)
    with pytest.raises(ValueError, match="reuse_prefix"):
        model.generate("hi", 2, n=2, reuse_prefix=True)
