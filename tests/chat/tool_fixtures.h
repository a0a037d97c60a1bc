// the tool-call tests' model and tools: tiny-qwen3 with Qwen2.5's jinja chat
// template (Hermes-style <tool_call> blocks), two functions whose every argument
// is bounded, and the check that a call's arguments follow its function's schema
#pragma once

#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

#include "kvblend/model_maker.h"
#include "kvblend/vocab.h"
#include "test_util.h"

namespace kvblend::test {

// tiny-qwen3 with the qwen2 vocabulary and Qwen2.5's chat template (made once per process)
inline const std::string & tool_model() {
    static const std::string path = [] {
        std::ifstream f(std::string(KVBLEND_LLAMA_DIR) + "/models/templates/Qwen-Qwen2.5-7B-Instruct.jinja");
        std::stringstream text;
        text << f.rdbuf();
        make_model_params mp;
        mp.wtype = GGML_TYPE_F32;
        mp.vocab_from = test::vocab_path("qwen2");
        mp.chat_template = text.str();
        const std::string out = test::process_dir().file("tiny-qwen3-qwen25-template.gguf");
        make_model(model_spec_preset("tiny-qwen3"), mp, out);
        return out;
    }();
    return path;
}

// a schema whose every value is bounded (an enum, an integer range, a boolean):
// random weights cannot run past max_tokens inside a string
inline const nlohmann::json k_weather_params = {{"type", "object"},
                                                {"properties",
                                                 {{"city", {{"enum", {"Paris", "Oslo", "Lima"}}}},
                                                  {"days", {{"type", "integer"}, {"minimum", 1}, {"maximum", 7}}},
                                                  {"metric", {{"type", "boolean"}}}}},
                                                {"required", {"city", "days", "metric"}},
                                                {"additionalProperties", false}};
inline const nlohmann::json k_time_params = {{"type", "object"},
                                             {"properties", {{"zone", {{"enum", {"UTC", "CET"}}}}}},
                                             {"required", {"zone"}},
                                             {"additionalProperties", false}};

inline nlohmann::json tools() {
    using json = nlohmann::json;
    return json::array(
        {{{"type", "function"},
          {"function",
           {{"name", "get_weather"}, {"description", "the weather of a city"}, {"parameters", k_weather_params}}}},
         {{"type", "function"},
          {"function", {{"name", "get_time"}, {"description", "the time in a zone"}, {"parameters", k_time_params}}}}});
}

// logit biases for tool_model(), {"token id": bias}: the ends of a turn made as
// likely as can be, so that random weights stop as soon as the grammar allows
// it (right after a call) instead of calling until max_tokens; compact: tokens
// of whitespace alone banned too, so that the grammar's optional whitespace
// between JSON values does not fill the answer
inline nlohmann::json tool_model_bias(bool compact) {
    const vocab v(tool_model());
    nlohmann::json bias = nlohmann::json::object();
    for (const char * end : {"<|im_end|>", "<|endoftext|>"}) {
        const std::vector<llama_token> t = v.tokenize(end, false, true);
        EXPECT_EQ(t.size(), 1u) << end;
        if (t.size() == 1) bias[std::to_string(t[0])] = 100;
    }
    for (llama_token t = 0; compact && t < v.n_tokens(); ++t) {
        const std::string piece = v.token_to_piece(t);
        if (!piece.empty() && piece.find_first_not_of(" \t\n\r") == std::string::npos) bias[std::to_string(t)] = -100;
    }
    return bias;
}

// a call's arguments: a JSON object of its function's schema
inline void expect_valid_call(const nlohmann::json & call) {
    using json = nlohmann::json;
    ASSERT_TRUE(call.is_object()) << call;
    EXPECT_EQ(call["type"], "function") << call;
    EXPECT_TRUE(call["id"].is_string() && !call["id"].get<std::string>().empty()) << call;
    const std::string name = call["function"]["name"];
    ASSERT_TRUE(call["function"]["arguments"].is_string()) << call;
    const json args = json::parse(call["function"]["arguments"].get<std::string>(), nullptr, false);
    ASSERT_TRUE(args.is_object()) << call;
    if (name == "get_weather") {
        EXPECT_EQ(args.size(), 3u) << call;
        EXPECT_TRUE(args["city"] == "Paris" || args["city"] == "Oslo" || args["city"] == "Lima") << call;
        EXPECT_TRUE(args["days"].is_number_integer() && args["days"] >= 1 && args["days"] <= 7) << call;
        EXPECT_TRUE(args["metric"].is_boolean()) << call;
    } else {
        EXPECT_EQ(name, "get_time") << call;
        EXPECT_TRUE(args.size() == 1 && (args["zone"] == "UTC" || args["zone"] == "CET")) << call;
    }
}

}  // namespace kvblend::test
