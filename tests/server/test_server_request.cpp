// the server's request checks as a function, without a model or a socket:
// JSON text to a checked request, or a request_error in OpenAI's shape
#include <gtest/gtest.h>

#include <chrono>

#include "kvblend/answer.h"
#include "server/server_request.h"

namespace kvblend {
namespace {

using json = nlohmann::json;

// the error a body gets, or "" when it passes
std::string error_code_of(request_kind kind, const std::string & body, int * status = nullptr) {
    try {
        request_parse(kind, body);
        return "";
    } catch (const request_error & e) {
        if (status) *status = e.status;
        EXPECT_FALSE(e.message.empty());
        EXPECT_NO_THROW(json::parse(error_body(e.message, e.type, e.code)));
        return e.code;
    }
}

std::string nested(int depth) {  // an object whose deepest value sits `depth` levels down
    std::string b = R"({"prompt":"x","x":)";
    for (int i = 1; i < depth; ++i) b += "[";
    b += "0";
    for (int i = 1; i < depth; ++i) b += "]";
    return b + "}";
}

// many sibling objects parse in linear time (nlohmann's callback parser took
// quadratic time: 2.5M "{}" in an 8 MB body held a core for minutes)
TEST(server_request, sibling_objects_parse_in_linear_time) {
    auto body_of = [](size_t n) {
        std::string b = R"({"prompt":"x","x":[)";
        for (size_t i = 0; i < n; ++i) b += i ? ",{}" : "{}";
        return b + "]}";
    };
    auto seconds = [&](size_t n) {
        const std::string b = body_of(n);
        const auto t0 = std::chrono::steady_clock::now();
        EXPECT_EQ(error_code_of(REQUEST_COMPLETION, b), "");
        return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    };
    seconds(20000);  // warm
    const double small = seconds(20000), large = seconds(200000);
    // 10x the objects: ~10x the time when linear, ~100x when quadratic
    EXPECT_LT(large, 35 * std::max(small, 1e-4)) << small << " s vs " << large << " s";
}

TEST(server_request, depth_is_bounded_while_parsing) {
    EXPECT_EQ(error_code_of(REQUEST_COMPLETION, nested(k_request_max_depth)), "");
    EXPECT_EQ(error_code_of(REQUEST_COMPLETION, nested(k_request_max_depth + 1)), "invalid_json");
    EXPECT_EQ(error_code_of(REQUEST_COMPLETION, std::string(200000, '[')), "invalid_json");
    EXPECT_EQ(error_code_of(REQUEST_COMPLETION, "{\"prompt\":" + std::string(200000, '{')), "invalid_json");
}

TEST(server_request, bad_bytes_and_bad_json_are_400_without_raw_text) {
    int status = 0;
    EXPECT_EQ(error_code_of(REQUEST_COMPLETION, "{\"prompt\":\"\xff\xfe\"}", &status), "invalid_json");
    EXPECT_EQ(status, 400);
    try {
        request_parse(REQUEST_COMPLETION, "{\"prompt\":\"a\xc0\"}");
        FAIL();
    } catch (const request_error & e) {
        EXPECT_EQ(e.message.find("json.exception"), std::string::npos) << e.message;
        EXPECT_EQ(e.message.find('\xc0'), std::string::npos);
    }
    EXPECT_EQ(error_code_of(REQUEST_COMPLETION, ""), "invalid_json");
    EXPECT_EQ(error_code_of(REQUEST_COMPLETION, "[1]"), "invalid_request");
    EXPECT_EQ(error_code_of(REQUEST_COMPLETION, "{\"prompt\":\"x\"} trailing"), "invalid_json");
}

TEST(server_request, fields_are_checked_per_endpoint) {
    const std::string msg = R"("messages":[{"role":"user","content":"hi"}])";
    EXPECT_EQ(error_code_of(REQUEST_CHAT, "{" + msg + "}"), "");
    EXPECT_EQ(error_code_of(REQUEST_CHAT, "{" + msg + R"(,"stream":"yes"})"), "invalid_request");
    EXPECT_EQ(error_code_of(REQUEST_CHAT, "{" + msg + R"(,"n":2})"), "invalid_request");
    EXPECT_EQ(error_code_of(REQUEST_CHAT, "{" + msg + R"(,"n":1,"stream":true,"stop":["a","b"]})"), "");
    EXPECT_EQ(error_code_of(REQUEST_CHAT, "{" + msg + R"(,"documents":[{"id":"a"},"text",{"text":"t"}]})"), "");
    EXPECT_EQ(error_code_of(REQUEST_CHAT, "{" + msg + R"(,"documents":{"text":"t"}})"), "invalid_request");
    EXPECT_EQ(error_code_of(REQUEST_CHAT, R"({"messages":[{"role":"user","content":[{"type":"image_url"}]}]})"),
              "invalid_request");
    EXPECT_EQ(error_code_of(REQUEST_CHAT, R"({"messages":[{"role":"user","content":[{"type":"text","text":"a"}]}]})"),
              "");
    EXPECT_EQ(error_code_of(REQUEST_COMPLETION, R"({"prompt":["one"]})"), "");
    // several prompts (one choice each), answered whole: up to k_max_prompts strings, not streamed
    EXPECT_EQ(error_code_of(REQUEST_COMPLETION, R"({"prompt":["one","two"]})"), "");
    // token ids (OpenAI's), strings among them (llama-server's mixed prompt), lists of them
    EXPECT_EQ(error_code_of(REQUEST_COMPLETION, R"({"prompt":["one",2]})"), "");
    EXPECT_EQ(error_code_of(REQUEST_COMPLETION, R"({"prompt":[[1,2],"two"]})"), "");
    EXPECT_EQ(error_code_of(REQUEST_COMPLETION, R"({"prompt":[["one"],2]})"), "invalid_request");
    EXPECT_EQ(error_code_of(REQUEST_COMPLETION, R"({"prompt":[1,-2]})"), "invalid_request");
    EXPECT_EQ(error_code_of(REQUEST_COMPLETION, R"({"prompt":[1,2.5]})"), "invalid_request");
    EXPECT_EQ(error_code_of(REQUEST_COMPLETION, R"({"prompt":[1,4294967296]})"), "invalid_request");
    EXPECT_EQ(error_code_of(REQUEST_COMPLETION, R"({"prompt":[[]]})"), "invalid_request");
    EXPECT_EQ(error_code_of(REQUEST_COMPLETION, R"({"max_tokens":2})"), "invalid_request");
    EXPECT_EQ(error_code_of(REQUEST_COMPLETION, R"({"prompt":[]})"), "invalid_request");
    EXPECT_EQ(error_code_of(REQUEST_COMPLETION, R"({"prompt":["one","two"],"stream":true})"), "unsupported_parameter");
    EXPECT_EQ(error_code_of(REQUEST_COMPLETION, R"({"prompt":["one"],"stream":true})"), "");
    const json many = {{"prompt", std::vector<std::string>(k_max_prompts + 1, "x")}};
    EXPECT_EQ(error_code_of(REQUEST_COMPLETION, many.dump()), "invalid_request");
    EXPECT_EQ(error_code_of(REQUEST_COMPLETION, R"({"prompt":"x","max_tokens":1e300})"), "invalid_request");
    EXPECT_EQ(error_code_of(REQUEST_COMPLETION, R"({"prompt":"x","max_tokens":8.0})"), "");
    EXPECT_EQ(error_code_of(REQUEST_COMPLETION, R"({"prompt":"x","temperature":-1})"), "invalid_request");
    // the token selection of fused requests
    EXPECT_EQ(error_code_of(REQUEST_CHAT, "{" + msg +
                                              R"(,"chunk_head":2,"head_in_budget":false,"weight_query":true,)"
                                              R"("budget":"mass","dev_mass":0.5,"recomp_ratio":0.1})"),
              "");
    for (const char * bad :
         {R"("chunk_head":-1)", R"("chunk_head":1.5)", R"("head_in_budget":"no")", R"("weight_query":1)",
          R"("budget":"local")", R"("budget":2)", R"("dev_mass":1.5)", R"("dev_mass":-0.1)"})
        EXPECT_EQ(error_code_of(REQUEST_CHAT, "{" + msg + "," + bad + "}"), "invalid_request") << bad;
    // a NUL in a message, as a string or a text part (libllama's templates would end it there)
    EXPECT_EQ(error_code_of(REQUEST_CHAT, R"({"messages":[{"role":"user","content":"a\u0000b"}]})"), "invalid_request");
    EXPECT_EQ(
        error_code_of(REQUEST_CHAT, R"({"messages":[{"role":"user","content":[{"type":"text","text":"a\u0000"}]}]})"),
        "invalid_request");
    EXPECT_EQ(error_code_of(REQUEST_CHAT, "{" + msg + R"(,"documents":[{"text":"t","id":"a"}]})"), "invalid_request");
    // refused rather than ignored; the values clients send by default pass
    for (const char * bad : {R"("functions":[{"name":"f"}])", R"("response_format":{"type":"xml"})"})
        EXPECT_EQ(error_code_of(REQUEST_CHAT, "{" + msg + "," + bad + "}"), "unsupported_parameter") << bad;
    // tools: a malformed one, a tool_choice naming none of them, a result answering no call
    for (
        const char * bad :
        {R"("tools":[{"type":"function"}])", R"("tools":[],"tool_choice":"required")",
         R"("tools":[{"type":"function","function":{"name":"f"}}],"tool_choice":{"type":"function","function":{"name":"g"}})",
         R"("tools":[{"type":"function","function":{"name":"f","parameters":[]}}])"})
        EXPECT_EQ(error_code_of(REQUEST_CHAT, "{" + msg + "," + bad + "}"), "invalid_request") << bad;
    EXPECT_EQ(error_code_of(REQUEST_CHAT, R"({"messages":[{"role":"tool","tool_call_id":"c","content":"1"}]})"),
              "invalid_request");
    // … and what passes: a required call, a named one, a round trip of a call and its result
    const std::string tool = R"("tools":[{"type":"function","function":{"name":"f","parameters":{"type":"object"}}}])";
    EXPECT_EQ(error_code_of(REQUEST_CHAT, "{" + msg + "," + tool + R"(,"tool_choice":"required"})"), "");
    EXPECT_EQ(error_code_of(REQUEST_CHAT,
                            "{" + msg + "," + tool + R"(,"tool_choice":{"type":"function","function":{"name":"f"}}})"),
              "");
    EXPECT_EQ(error_code_of(REQUEST_CHAT,
                            R"({"messages":[{"role":"user","content":"x"},{"role":"assistant","content":null,)"
                            R"("tool_calls":[{"id":"c","type":"function","function":{"name":"f","arguments":"{}"}}]},)"
                            R"({"role":"tool","tool_call_id":"c","content":"1"}],)" +
                                tool + "}"),
              "");
    EXPECT_EQ(
        error_code_of(REQUEST_COMPLETION, R"({"prompt":"x","tools":[{"type":"function","function":{"name":"f"}}]})"),
        "invalid_request");
    // constrained output and log-probabilities: honoured when well formed
    for (
        const char * good :
        {R"("response_format":{"type":"json_object"})", R"("logprobs":true)", R"("logprobs":true,"top_logprobs":20)",
         R"("response_format":{"type":"json_schema","json_schema":{"name":"x","strict":true,"schema":{"type":"object","properties":{"a":{"type":"integer"}}}}})",
         R"("response_format":{"type":"json_object","schema":{"type":"array"}})", R"("n_probs":3)"})
        EXPECT_EQ(error_code_of(REQUEST_CHAT, "{" + msg + "," + good + "}"), "") << good;
    for (const char * bad :
         {R"("top_logprobs":2)", R"("logprobs":true,"top_logprobs":21)", R"("logprobs":true,"top_logprobs":-1)",
          R"("logprobs":"yes")", R"("n_probs":1.5)", R"("response_format":"json")",
          R"("response_format":{"type":"json_schema"})", R"("response_format":{"type":"json_schema","json_schema":5})",
          R"("response_format":{"type":"json_schema","json_schema":{"schema":{},"strict":"yes"}})",
          R"("response_format":{"type":"json_object"},"grammar":"root ::= \"x\"")",
          R"("grammar":"root ::= \"x\"","json_schema":{"type":"object"})", R"("grammar":5)", R"("json_schema":"{}")"})
        EXPECT_EQ(error_code_of(REQUEST_CHAT, "{" + msg + "," + bad + "}"), "invalid_request") << bad;
    // a schema the converter cannot express names why
    for (const char * bad :
         {R"("json_schema":{"type":"string","pattern":"^(?=a)$"})", R"("json_schema":{"$ref":"#/definitions/missing"})",
          R"("json_schema":{"type":"array","items":{"type":"integer"},"minItems":100000})"})
        EXPECT_EQ(error_code_of(REQUEST_CHAT, "{" + msg + "," + bad + "}"), "invalid_json_schema") << bad;
    for (const char * bad : {R"("top_k":1.5)", R"("min_p":2)"})
        EXPECT_EQ(error_code_of(REQUEST_CHAT, "{" + msg + "," + bad + "}"), "invalid_request") << bad;
    EXPECT_EQ(
        error_code_of(REQUEST_CHAT,
                      "{" + msg + R"(,"response_format":{"type":"text"},"tools":[],"logprobs":false,"top_k":-1})"),
        "");
    // OpenAI's and llama-server's other fields: honoured, refused, or passed at their defaults
    for (const char * bad :
         {R"("echo":true)", R"("suffix":"end")", R"("best_of":3)", R"("mirostat":2)", R"("typical_p":0.5)"})
        EXPECT_EQ(error_code_of(REQUEST_COMPLETION, R"({"prompt":"x",)" + std::string(bad) + "}"),
                  "unsupported_parameter")
            << bad;
    EXPECT_EQ(error_code_of(REQUEST_COMPLETION, R"({"prompt":"x","grammar":"root ::= \"x\"","logprobs":5})"), "");
    EXPECT_EQ(error_code_of(REQUEST_COMPLETION, R"({"prompt":"x","logprobs":true,"top_logprobs":2})"),
              "invalid_request");
    EXPECT_EQ(
        error_code_of(REQUEST_COMPLETION, R"({"prompt":"x","echo":false,"suffix":null,"best_of":1,"grammar":"",)"
                                          R"("json_schema":{},"n_probs":0,"mirostat":0,"typical_p":1,"logit_bias":{},)"
                                          R"("frequency_penalty":0,"presence_penalty":0,"seed":-1})"),
        "");
    EXPECT_EQ(error_code_of(REQUEST_CHAT, "{" + msg +
                                              R"(,"logit_bias":{"13":-100,"400":5.5},"frequency_penalty":1.5,)"
                                              R"("presence_penalty":-2,"repeat_penalty":1.1,"repeat_last_n":-1,)"
                                              R"("seed":9000000000000000000})"),
              "");
    for (const char * bad :
         {R"("logit_bias":{"x":1})", R"("logit_bias":{"-1":1})", R"("logit_bias":{"1":101})",
          R"("logit_bias":{"1":"1"})", R"("logit_bias":[1])", R"("logit_bias":{"99999999999":1})",
          R"("frequency_penalty":2.5)", R"("presence_penalty":"1")", R"("repeat_penalty":0)",
          R"("repeat_penalty":1.1,"repetition_penalty":1.1)", R"("repeat_last_n":-2)", R"("seed":-2)", R"("seed":1.5)"})
        EXPECT_EQ(error_code_of(REQUEST_CHAT, "{" + msg + "," + bad + "}"), "invalid_request") << bad;
    // a stop string is held back from a stream while it may still appear: its length is bounded
    EXPECT_EQ(
        error_code_of(REQUEST_COMPLETION, R"({"prompt":"x","stop":")" + std::string(k_max_stop_bytes, 'q') + R"("})"),
        "");
    EXPECT_EQ(error_code_of(REQUEST_COMPLETION,
                            R"({"prompt":"x","stop":")" + std::string(k_max_stop_bytes + 1, 'q') + R"("})"),
              "invalid_request");
    EXPECT_EQ(error_code_of(REQUEST_COMPLETION,
                            R"({"prompt":"x","stop":["a",")" + std::string(k_max_stop_bytes + 1, 'q') + R"("]})"),
              "invalid_request");
    EXPECT_EQ(error_code_of(REQUEST_DOCUMENTS, R"({"documents":[]})"), "invalid_request");
    EXPECT_EQ(error_code_of(REQUEST_DOCUMENTS, R"({"documents":[{"id":"x"}]})"),
              "invalid_request");  // ids are for chat
    EXPECT_EQ(error_code_of(REQUEST_TOKENIZE, R"({"content":"x","add_special":null})"), "");
    EXPECT_EQ(error_code_of(REQUEST_DETOKENIZE, R"({"tokens":[1.5]})"), "invalid_request");
    // what passes can be read as checked
    const request_spec r = request_parse(REQUEST_COMPLETION, R"({"prompt":"x","stream":true,"n":null})");
    EXPECT_TRUE(r.stream);
    EXPECT_FALSE(r.body.contains("n"));
}

// what a stream may emit: whole UTF-8 characters, nothing that may begin a stop string
TEST(server_request, a_stream_emits_whole_characters_and_holds_only_a_stop_prefix) {
    const std::string two = "\xd2\x8c", three = "\xe2\x82\xac", four = "\xf0\x9f\x98\x80";
    EXPECT_EQ(utf8_whole("abc", 3), 3u);
    EXPECT_EQ(utf8_whole("", 0), 0u);
    for (const std::string & c : {two, three, four}) {
        const std::string t = "be" + c;
        EXPECT_EQ(utf8_whole(t, t.size()), t.size()) << c.size();
        for (size_t cut = 1; cut < c.size(); ++cut) EXPECT_EQ(utf8_whole(t, 2 + cut), 2u) << c.size() << "/" << cut;
    }
    // bytes no continuation can complete pass through
    EXPECT_EQ(utf8_whole("a\x80\x80\x80\x80", 5), 5u);
    EXPECT_EQ(utf8_whole("a\xff", 2), 2u);
    EXPECT_EQ(stop_prefix_tail("the end. Que", {"Question:"}), 3u);
    EXPECT_EQ(stop_prefix_tail("the end. Quo", {"Question:"}), 0u);
    EXPECT_EQ(stop_prefix_tail("a\n", {"\n\n", "xyz"}), 1u);
    EXPECT_EQ(stop_prefix_tail("ab", {""}), 0u);
    EXPECT_EQ(stop_prefix_tail("x", {std::string(1000, 'x')}), 1u);
}

}  // namespace
}  // namespace kvblend
