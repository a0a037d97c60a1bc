// Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens) on
// the chat path: a body is read into the chat body it means (system, content
// blocks, tool_use and tool_result, text document blocks opening the first
// user message as fused documents), the chat answer is written back as an
// Anthropic message or its stream of events, and errors in Anthropic's shape.
#pragma once

#include <nlohmann/json.hpp>
#include <string>

#include "server/server_response.h"

namespace kvblend {

constexpr size_t k_max_message_blocks = 4096;  // content blocks of one request, all messages together

// the Messages-only fields of a body, checked (the chat fields it becomes are
// checked as chat's); count: /count_tokens, where max_tokens is not asked. throws request_error
void check_messages_body(const nlohmann::json & b, bool count);

// a checked Messages body as the chat body it means
nlohmann::json messages_chat_body(const nlohmann::json & b);

// Anthropic's error body {"type": "error", "error": {"type", "message"}} for an HTTP status
std::string anthropic_error_body(int status, const std::string & message);

// the message of a finished chat.completion; stop_word: the stop sequence that ended it ("" none)
nlohmann::json message_of_chat(const nlohmann::json & completion, const std::string & stop_word);

// the stream: message_start, each content block's start, deltas and stop, message_delta, message_stop
class messages_events : public answer_events {
  public:
    messages_events(const openai_format & f, const job & j);  // its first take() comes after the prefill
    bool take(job & j, std::string & out) override;

  private:
    void close_block(std::string & out);
    void on_delta(std::string & out, const nlohmann::json & delta);

    completion_events chunks_;
    std::string id_, model_;
    bool started_ = false;
    int64_t blocks_ = 0;               // content blocks started
    bool open_ = false;                // the last one is not stopped yet
    bool in_text_ = false;             // … and is a text block
    std::vector<int64_t> call_block_;  // each tool call's block index (by the call's index)
    std::string finish_;
    nlohmann::json kvblend_;
};

}  // namespace kvblend
