// tool calls through the pinned llama.cpp's chat code (common/chat.h, built as
// kvblend_chat): the model's jinja chat template renders the conversation with
// the tools, the template's format gives the grammar of a call (lazy, from
// its trigger, for tool_choice "auto"; from the first token for "required"
// or a named function) and the parser that turns the answer's text back into
// OpenAI's message.tool_calls, whole or as streamed deltas.
#pragma once

#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "kvblend/sampler.h"
#include "kvblend/vocab.h"
#include "server/server_request.h"

namespace kvblend {

// how one request's answer is constrained and read back
struct tool_plan {
    std::string prompt;                  // the rendered conversation, up to the assistant's turn
    bool calls = false;                  // the answer may hold calls (else it is plain text)
    std::string grammar;                 // GBNF of the calls ("" none)
    bool lazy = false;                   // the grammar binds from a trigger on
    std::vector<std::string> patterns;   // trigger regexes over the generated text
    std::vector<llama_token> triggers;   // trigger tokens
    std::vector<llama_token> prefill;    // not lazy: the generation prompt's tokens, which the grammar begins with
    std::vector<llama_token> preserved;  // control tokens the parser must see as text (sorted)
    std::vector<std::string> stops;      // stop strings of the template's format
    std::string parser;                  // the format's parser, serialized
    std::string generation_prompt;       // what the parser reads before the answer
    int format = 0;                      // common_chat_format
};

// the sampler settings of a plan (grammar, laziness, triggers)
void tool_plan_apply(const tool_plan & plan, sampler_params & sp);

// an answer's text read as an assistant message: "content" (null when only
// calls were made) and "tool_calls" [{"id", "type": "function", "function":
// {"name", "arguments"}}]; text that does not parse is content
class tool_reader {
  public:
    explicit tool_reader(const tool_plan & plan);
    ~tool_reader();
    // the whole answer (cut: ended by max_tokens, its last call may be unfinished)
    nlohmann::json message(const std::string & text, bool cut);
    // a stream's deltas ({"content"} or {"tool_calls": [{"index", …}]}) from the last
    // message read to the one of text so far (none while it does not parse yet);
    // done: the answer is complete, read as message() reads it
    std::vector<nlohmann::json> deltas(const std::string & text, bool done, bool cut);
    bool made_calls() const;  // the last message read holds a call

  private:
    struct impl;
    std::unique_ptr<impl> d_;
};

// the model's chat templates, loaded once per server
class tool_templates {
  public:
    explicit tool_templates(const vocab & v);  // throws kvblend::error when the template does not parse
    ~tool_templates();
    // the plan of a checked chat request (request_tools said render); throws request_error
    tool_plan plan(const nlohmann::json & body, const tool_request & tr) const;

  private:
    struct impl;
    std::unique_ptr<impl> d_;
};

}  // namespace kvblend
