"""Constrained answers from Python: response_format / json_schema / grammar on
complete() and blend(), and the argument names the openai client and
llama-cpp-python use (max_tokens, temperature) beside ours."""

import json
import os

import pytest

import kvblend

MODEL = os.environ["KVBLEND_TEST_MODEL"]

PERSON = {"type": "object",
          "properties": {"pet": {"enum": ["cat", "dog"]}, "age": {"type": "integer", "minimum": 1, "maximum": 9}},
          "required": ["pet", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def model():
    with kvblend.Model(MODEL) as m:
        yield m


def check_person(text):
    out = json.loads(text)
    assert out["pet"] in ("cat", "dog"), text
    assert 1 <= out["age"] <= 9, text
    assert set(out) == {"pet", "age"}, text


@pytest.mark.parametrize("how", [
    {"json_schema": PERSON},
    {"json_schema": json.dumps(PERSON)},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}},
])
def test_complete_follows_a_schema(model, how):
    for seed in (1, 2, 3):
        r = model.complete("Once upon a time", max_tokens=80, temperature=1.0, seed=seed, **how)
        check_person(r.text)
        assert r.stats.stop_reason == "eog"


def test_blend_follows_a_schema(model, tmp_path):
    with kvblend.Store(str(tmp_path / "store")) as st:
        r = model.blend("", ["Lily had a cat.", "Tom had a dog."], "Who has a pet?", store=st, max_tokens=80,
                        temperature=1.0, seed=4, response_format={"type": "json_schema",
                                                                  "json_schema": {"schema": PERSON}})
    check_person(r.text)


def test_json_object_and_grammar(model):
    r = model.complete("Once upon a time", max_tokens=8, grammar='root ::= [0-9]{3} "!"')
    assert len(r.text) == 4 and r.text[:3].isdigit() and r.text[3] == "!", r.text
    r = model.complete("Once upon a time", max_tokens=200, temperature=1.0, seed=5,
                       response_format={"type": "json_object"})
    if r.stats.stop_reason == "eog":
        assert isinstance(json.loads(r.text), dict), r.text
    else:
        assert r.text.startswith("{"), r.text
    # a grammar longer than max_tokens ends at the limit
    r = model.complete("Once upon a time", max_tokens=4, grammar='root ::= "x"{100}')
    assert r.stats.stop_reason == "length"
    # text is free text
    assert model.complete("Once upon a time", max_tokens=6, response_format={"type": "text"}).text == \
        model.complete("Once upon a time", n_predict=6).text


def test_openai_names_are_the_same_as_ours(model):
    a = model.complete("Once upon a time", n_predict=10, temp=0.7, seed=3)
    b = model.complete("Once upon a time", max_tokens=10, temperature=0.7, seed=3)
    assert a.text == b.text and a.stats.n_gen == b.stats.n_gen == 10
    with pytest.raises(TypeError):
        model.complete("x", n_predict=3, max_tokens=3)
    with pytest.raises(TypeError):
        model.complete("x", json_schema=PERSON, grammar="root ::= \"a\"")
    pieces = list(model.generate("Once upon a time", max_tokens=5, grammar='root ::= [a-z]+'))
    assert "".join(pieces).isalpha()


@pytest.mark.parametrize("bad, says", [
    ({"json_schema": "{not json"}, "not JSON"),
    ({"json_schema": {"type": "string", "pattern": "^(?=x)$"}}, "schema"),
    ({"json_schema": {"type": "array", "items": {"type": "integer"}, "minItems": 100000}}, "repeats"),
    ({"grammar": "root ::= nowhere"}, "GBNF"),
    ({"response_format": {"type": "xml"}}, "not supported"),
    ({"response_format": {"type": "json_schema"}}, "json_schema"),
])
def test_bad_constraints_raise_with_the_reason(model, bad, says):
    with pytest.raises(kvblend.InvalidArgumentError) as e:
        model.complete("x", max_tokens=3, **bad)
    assert says in str(e.value)


def test_logprobs_are_the_sampled_tokens_in_openai_shapes(model, tmp_path):
    plain = model.complete("Once upon a time", max_tokens=10)
    r = model.complete("Once upon a time", max_tokens=10, top_logprobs=3)
    assert r.text == plain.text and plain.logprobs is None
    assert len(r.logprobs) == r.stats.n_gen
    assert "".join(bytes(e["bytes"]).decode() for e in r.logprobs) == r.text
    for e in r.logprobs:
        assert len(e["top_logprobs"]) == 3
        # greedy: the sampled token is the most likely one
        assert e["top_logprobs"][0]["token"] == e["token"] and e["top_logprobs"][0]["logprob"] == e["logprob"]
        assert e["logprob"] <= 0
    assert model.complete("Once upon a time", max_tokens=10, logprobs=True).logprobs[0]["top_logprobs"] == []

    # chat shape, streamed and not
    msgs = [{"role": "user", "content": "Once upon a time"}]
    whole = model.create_chat_completion(msgs, max_tokens=8, temperature=0, logprobs=True, top_logprobs=2)
    content = whole["choices"][0]["logprobs"]["content"]
    assert "".join(e["token"] for e in content) == whole["choices"][0]["message"]["content"]
    chunks = list(model.create_chat_completion(msgs, max_tokens=8, temperature=0, logprobs=True, top_logprobs=2,
                                               stream=True))
    streamed = [e for c in chunks[:-1] for e in c["choices"][0]["logprobs"]["content"]]
    assert streamed == content

    # the completions endpoint's legacy object
    legacy = model.create_completion("Once upon a time", max_tokens=6, temperature=0, logprobs=2)
    lp = legacy["choices"][0]["logprobs"]
    assert "".join(lp["tokens"]) == legacy["choices"][0]["text"]
    assert all(max(top.values()) == p for top, p in zip(lp["top_logprobs"], lp["token_logprobs"]))
    assert lp["text_offset"][0] == 0

    # blend too; out-of-range counts are refused with the reason
    b = model.blend("Stories.", ["Tom had a red ball."], "Tom", max_tokens=6, logprobs=True)
    assert len(b.logprobs) == b.stats.n_gen
    with pytest.raises(kvblend.InvalidArgumentError, match="top_logprobs"):
        model.complete("Once", top_logprobs=21)
