"""llama-cpp-python's calls on kvblend.Model: create_completion and
create_chat_completion answer in OpenAI's shapes, streamed too, with a JSON
schema and with documents; Model(model_path=…, verbose=…)."""

import json
import os

import pytest

import kvblend

MODEL = os.environ["KVBLEND_TEST_MODEL"]


@pytest.fixture(scope="module")
def model():
    with kvblend.Model(model_path=MODEL, verbose=False) as m:
        yield m


def test_create_completion_is_openai_shaped(model):
    r = model.create_completion("Once upon a time", max_tokens=8, temperature=0)
    assert r["object"] == "text_completion"
    assert r["choices"][0]["text"].startswith(", there was a little girl"), r
    assert r["choices"][0]["finish_reason"] == "length"
    assert r["usage"]["completion_tokens"] == 8
    chunks = list(model.create_completion("Once upon a time", max_tokens=8, temperature=0, stream=True))
    assert "".join(c["choices"][0]["text"] for c in chunks) == r["choices"][0]["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_create_chat_completion_with_a_schema_and_with_documents(model, tmp_path):
    schema = {"type": "object", "properties": {"pet": {"enum": ["cat", "dog"]}}, "required": ["pet"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}}
    r = model.create_chat_completion([{"role": "user", "content": "Which pet?"}], max_tokens=40, temperature=1.0,
                                     seed=2, response_format=fmt)
    assert r["object"] == "chat.completion"
    assert r["choices"][0]["message"]["role"] == "assistant"
    assert json.loads(r["choices"][0]["message"]["content"])["pet"] in ("cat", "dog")
    with kvblend.Store(str(tmp_path / "s")) as st:
        d = model.create_chat_completion([{"role": "system", "content": "Stories:"},
                                          {"role": "user", "content": "Which pet?"}],
                                         documents=["Lily had a cat.", "Tom had a dog."], store=st, max_tokens=40,
                                         temperature=1.0, seed=3, response_format=fmt)
    assert json.loads(d["choices"][0]["message"]["content"])["pet"] in ("cat", "dog")
    assert d["usage"]["prompt_tokens"] > 5
    chunks = list(model.create_chat_completion([{"role": "user", "content": "Once upon a time"}], max_tokens=5,
                                               temperature=0, stream=True))
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    with pytest.raises(kvblend.InvalidArgumentError):
        model.create_chat_completion([{"role": "user", "content": "x"}], tools=[{"type": "function"}])
    with pytest.raises(TypeError):
        kvblend.Model(MODEL, model_path=MODEL)
