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

#include "kvblend/common.h"
#include "kvblend/sampler.h"
#include "kvblend/vocab.h"

namespace kvblend {

// a chat request the tool code cannot take, with an OpenAI-style error code
// ("invalid_request", "invalid_json_schema"): the server answers it with a
// 400, the C API with KVB_ERR_INVALID_ARGUMENT
class chat_error : public error {
  public:
    chat_error(const std::string & msg, std::string code = "invalid_request")
        : error(msg, error_kind::invalid_argument), code(std::move(code)) {}
    std::string code;
};

// what a chat request asks of tool calls (OpenAI's tools, tool_choice, parallel_tool_calls)
struct tool_request {
    bool render = false;          // the chat code renders the prompt: tools, or tool calls and results in the messages
    bool calls = false;           // the answer may hold tool calls (tools given, tool_choice not "none")
    std::string choice = "auto";  // auto, none, required, or "function": the one named
    std::string function;         // choice "function": its name
    bool parallel = true;         // more than one call per answer
};
constexpr size_t k_max_tools = 128;  // tools one request may give

// the tool fields of a chat body, checked: every tool a function with a name and
// a parameters schema the converter can express, a tool_choice naming one of
// them, the messages' tool calls and tool results (check_tool_messages); throws chat_error
tool_request read_tool_request(const nlohmann::json & body);

// the "tool_calls" of assistant messages and the "tool" messages that answer
// them, each naming an earlier call; throws chat_error
void check_tool_messages(const nlohmann::json & messages);

// how one request's answer is constrained and read back
struct tool_plan {
    std::string prompt;                  // the rendered conversation, up to the assistant's turn
    bool calls = false;                  // the answer may hold calls (else it is plain text)
    bool parallel = true;                // … more than one (else the first is the answer's only call)
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

// the body with one k_rag_doc_mark per document opening its first user
// message, where rag_prompt_cut_at_marks finds them in the rendered prompt
// (the tools stay in the system part before them); throws chat_error
nlohmann::json chat_with_doc_marks(nlohmann::json body, size_t n_docs);

// a chat body's "messages" as the template renderer reads them: "developer"
// is "system", a content its text (a string, or its text parts in order; none: "")
std::vector<chat_message> chat_messages_of(const nlohmann::json & messages);

class tool_templates;
// the plan of any chat body read by read_tool_request, n_docs documents
// opening its first user message: with tools or tool messages (tr.render) the
// jinja chat code's (tmpl), else the model's template as libllama applies it
// (rag_conversation_render) and no calls. throws chat_error, or kvblend::error
// when the model has no template (or tmpl is null where it is needed)
tool_plan chat_plan(const vocab & v, const tool_templates * tmpl, nlohmann::json body, const tool_request & tr,
                    size_t n_docs);

// the model's chat templates, loaded once per server
class tool_templates {
  public:
    explicit tool_templates(const vocab & v);  // throws kvblend::error when the template does not parse
    ~tool_templates();
    // the plan of a chat body read by read_tool_request; throws chat_error
    tool_plan plan(const nlohmann::json & body, const tool_request & tr) const;

  private:
    struct impl;
    std::unique_ptr<impl> d_;
};

}  // namespace kvblend
