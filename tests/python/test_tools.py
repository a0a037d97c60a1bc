"""Tool calls from Python, in llama-cpp-python's and OpenAI's shapes:
create_chat_completion(tools=…, tool_choice=…) renders the tools with the
model's jinja template, samples the calls under the template's grammar and
returns message.tool_calls (streamed as tool_calls deltas); a tool result
carries the conversation on; documents fuse under any conversation. The model
has random weights: the grammar alone makes the calls parse, which is what
these tests assert, each call's arguments checked against its schema."""

import json
import os
import re
import subprocess
import urllib.request

import pytest

import kvblend

LLAMA_DIR = os.environ["KVBLEND_LLAMA_DIR"]

WEATHER = {"type": "object",
           "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]},
                          "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the weather of a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "the time in a zone",
                                           "parameters": {"type": "object",
                                                          "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                                          "required": ["zone"], "additionalProperties": False}}}]
ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]
CALL = dict(tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_tokens=80, temperature=1.0)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tools") / "tiny-qwen3-tools.gguf")
    subprocess.run([os.environ["KVBLEND_CLI"], "make-model", "--preset", "tiny-qwen3", "--type", "f32",
                    "--vocab-from", LLAMA_DIR + "/models/ggml-vocab-qwen2.gguf",
                    "--chat-template", LLAMA_DIR + "/models/templates/Qwen-Qwen2.5-7B-Instruct.jinja", "-o", path],
                   check=True, capture_output=True)
    with kvblend.Model(model_path=path, verbose=False) as m:
        # random weights stop as soon as the grammar lets them (the ends of a turn
        # made likely) and write no whitespace between JSON values (tokens of
        # whitespace alone banned): short answers that end right after the call
        pieces = ((t, m.detokenize([t])) for t in range(m.n_vocab))
        bias = {t: -100 for t, p in pieces if p and not p.strip(" \t\n\r")}
        bias.update({t: 100 for t in m.tokenize("<|im_end|><|endoftext|>", add_special=False, parse_special=True)})
        CALL["logit_bias"] = bias
        yield m


def check_call(call):
    assert call["type"] == "function" and call["id"], call
    args = json.loads(call["function"]["arguments"])
    if call["function"]["name"] == "get_weather":
        assert args["city"] in ("Paris", "Oslo", "Lima") and 1 <= args["days"] <= 7 and len(args) == 2, call
    else:
        assert call["function"]["name"] == "get_time" and args == {"zone": args["zone"]}, call
        assert args["zone"] in ("UTC", "CET"), call


def test_required_and_named_calls_come_back_as_tool_calls(model):
    r = model.create_chat_completion(ASK, seed=1, **CALL)
    assert r["object"] == "chat.completion"
    choice = r["choices"][0]
    assert choice["finish_reason"] == "tool_calls", r
    assert choice["message"]["role"] == "assistant" and choice["message"]["content"] is None, r
    assert len(choice["message"]["tool_calls"]) == 1, r
    check_call(choice["message"]["tool_calls"][0])
    assert r["usage"]["completion_tokens"] > 5
    named = dict(CALL, tool_choice={"type": "function", "function": {"name": "get_time"}})
    r = model.create_chat_completion(ASK, seed=2, **named)
    call = r["choices"][0]["message"]["tool_calls"][0]
    assert call["function"]["name"] == "get_time", r
    check_call(call)


def test_streamed_deltas_add_up_to_the_whole_answer(model):
    whole = model.create_chat_completion(ASK, seed=3, **CALL)["choices"][0]["message"]["tool_calls"][0]
    chunks = list(model.create_chat_completion(ASK, seed=3, stream=True, **CALL))
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls", chunks[-1]
    calls = [d["tool_calls"][0] for c in chunks for d in [c["choices"][0]["delta"]] if "tool_calls" in d]
    assert calls and calls[0]["function"]["name"] == whole["function"]["name"], calls
    assert all(c["index"] == 0 for c in calls) and sum("id" in c for c in calls) == 1, calls
    args = "".join(c["function"]["arguments"] for c in calls)
    assert json.loads(args) == json.loads(whole["function"]["arguments"])


def test_a_tool_result_carries_the_conversation_on(model):
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": "Oslo", "days": 1})}}
    turns = ASK + [{"role": "assistant", "content": None, "tool_calls": [call]},
                   {"role": "tool", "tool_call_id": "call_1", "content": "light snow"}]
    r = model.create_chat_completion(turns, tools=TOOLS, tool_choice="none", max_tokens=6, temperature=0)
    msg = r["choices"][0]["message"]
    assert "tool_calls" not in msg and isinstance(msg["content"], str), r
    assert r["choices"][0]["finish_reason"] in ("stop", "length")
    # the result is in the prompt: the same turns without it prompt fewer tokens
    short = model.create_chat_completion(turns[:2] + [{"role": "tool", "tool_call_id": "call_1", "content": "x"}],
                                         tools=TOOLS, tool_choice="none", max_tokens=1, temperature=0)
    assert r["usage"]["prompt_tokens"] > short["usage"]["prompt_tokens"]
    with pytest.raises(kvblend.InvalidArgumentError, match="matches no tool call"):
        model.create_chat_completion(ASK + [{"role": "tool", "tool_call_id": "call_9", "content": "x"}])


def test_documents_fuse_under_tools_and_under_a_conversation(model, tmp_path):
    docs = ["Oslo lies at the end of a fjord.", "Lima lies by the Pacific."]
    with kvblend.Store(str(tmp_path / "s")) as st:
        r = model.create_chat_completion(ASK, documents=docs, store=st, seed=4, **CALL)
        check_call(r["choices"][0]["message"]["tool_calls"][0])
        assert st.stats().n_entries >= 2  # the documents were collected and put
        talk = [{"role": "user", "content": "Tell me of Oslo."}, {"role": "assistant", "content": "A fjord city."},
                {"role": "user", "content": "And Lima?"}]
        r = model.create_chat_completion(talk, documents=docs, store=st, max_tokens=4, temperature=0)
        assert isinstance(r["choices"][0]["message"]["content"], str), r
        assert r["usage"]["prompt_tokens"] > 20
        pieces = list(model.create_chat_completion(talk, documents=docs, store=st, max_tokens=4, temperature=0,
                                                   stream=True))
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in pieces)
        assert text == r["choices"][0]["message"]["content"]


@pytest.fixture(scope="module")
def server(model):
    """kvblend serve on the same GGUF (port 0: the one it announces)."""
    p = subprocess.Popen([os.environ["KVBLEND_CLI"], "serve", "-m", model.path, "--port", "0", "-c", "1024", "--quiet"],
                         stderr=subprocess.PIPE, text=True)
    try:
        url = None
        for line in p.stderr:
            found = re.search(r"on (http://[\d.]+:\d+)", line)
            if found:
                url = found.group(1)
                break
        assert url, "the server did not start"
        yield url
    finally:
        p.terminate()
        p.wait(timeout=30)


def served_chat(url, body):
    req = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


@pytest.mark.parametrize("messages", [
    [{"role": "user", "content": "Tell me of Oslo."}, {"role": "user", "content": "And Lima?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "developer", "content": "Use the documents."},
     {"role": "user", "content": "Which city?"}],
    [{"role": "user", "content": "Tell me of Oslo."}, {"role": "assistant", "content": "A fjord city."},
     {"role": "user", "content": "And Lima?"}],
    [{"role": "user", "content": [{"type": "text", "text": "Which "}, {"type": "text", "text": "city?"}]}],
], ids=["two_user_turns", "two_system_messages", "user_assistant_user", "text_parts"])
def test_a_conversation_over_documents_is_the_servers_prompt(model, server, messages):
    # the one conversation builder: every turn kept, the documents opening the
    # first user message, whether Python or the server builds it (same GGUF)
    docs = ["Oslo lies at the end of a fjord.", "Lima lies by the Pacific."]
    ours = model.create_chat_completion(messages, documents=docs, max_tokens=4, temperature=0)
    theirs = served_chat(server, {"messages": messages, "documents": docs, "max_tokens": 4, "temperature": 0})
    assert ours["usage"]["prompt_tokens"] == theirs["usage"]["prompt_tokens"]
    assert ours["choices"][0]["message"]["content"] == theirs["choices"][0]["message"]["content"]
    plain = model.create_chat_completion(messages, max_tokens=4, temperature=0)
    served = served_chat(server, {"messages": messages, "max_tokens": 4, "temperature": 0})
    assert plain["usage"]["prompt_tokens"] == served["usage"]["prompt_tokens"]
    assert plain["usage"]["prompt_tokens"] < ours["usage"]["prompt_tokens"]


def test_bad_tool_requests_raise_with_the_reason(model):
    with pytest.raises(kvblend.InvalidArgumentError, match="not one of 'tools'"):
        model.create_chat_completion(ASK, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "x"}})
    with pytest.raises(kvblend.InvalidArgumentError, match="tool_choice"):
        model.create_chat_completion(ASK, tools=TOOLS, tool_choice="sometimes")
    with pytest.raises(kvblend.InvalidArgumentError, match="not streamed"):
        model.create_chat_completion(ASK, stream=True, logprobs=True, **CALL)
    with pytest.raises(kvblend.InvalidArgumentError, match="grammar"):
        model.create_chat_completion(ASK, response_format={"type": "json_object"}, **CALL)
