// OpenAI's Responses API (POST /v1/responses) on the chat path: a body is read
// into the chat body it means (input items to messages, instructions to the
// system message, flat function tools, text.format to response_format), the
// chat answer is written back as a response object or as the stream of
// response.* events, and the responses kept for previous_response_id are here.
#pragma once

#include <cstdint>
#include <deque>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <unordered_map>

#include "server/server_response.h"

namespace kvblend {

constexpr size_t k_max_response_items = 4096;  // input items of one request

// the Responses-only fields of a body, checked (the chat fields it becomes are
// checked as chat's); throws request_error
void check_responses_body(const nlohmann::json & b);

// what a later request continues with previous_response_id: the conversation
// so far (the instructions excepted, as OpenAI's) and the documents it had
struct stored_response {
    nlohmann::json messages = nlohmann::json::array();
    nlohmann::json documents;  // null: none
};

constexpr size_t k_kept_responses = 1024;                     // responses kept for previous_response_id …
constexpr size_t k_kept_response_bytes = (size_t) 256 << 20;  // … and their conversations' bytes together

// the last responses, kept in memory for previous_response_id; the oldest
// forgotten past max_entries or max_bytes (a conversation larger than that is not kept)
class response_log {
  public:
    response_log(size_t max_entries, size_t max_bytes) : max_entries_(max_entries), max_bytes_(max_bytes) {}
    void put(const std::string & id, stored_response r);
    std::optional<stored_response> get(const std::string & id) const;
    size_t size() const;

  private:
    struct entry {
        stored_response r;
        size_t bytes;
    };
    mutable std::mutex mu_;
    size_t max_entries_, max_bytes_, bytes_ = 0;
    std::deque<std::string> order_;  // ids, oldest first
    std::unordered_map<std::string, entry> by_id_;
};

// a checked Responses body as the chat body it means; prev: the response it
// continues (null: none). the messages without the instructions go to `kept`
nlohmann::json responses_chat_body(const nlohmann::json & b, const stored_response * prev, stored_response & kept);

// what every answer of one response repeats: its id, time and the request's settings
struct response_meta {
    std::string id;  // resp_…
    int64_t created_at = 0;
    std::string model;
    nlohmann::json request;  // the Responses body (its settings are echoed)
};
response_meta response_meta_new(const std::string & model, const nlohmann::json & request);

// the response object of a finished chat.completion
nlohmann::json response_of_chat(const nlohmann::json & completion, const response_meta & m);

// a chat message of the assistant's output (its content and tool calls), as a later request reads it
nlohmann::json assistant_message_of(const nlohmann::json & response);

// the stream: response.created, the output items' events, response.completed
// (or .incomplete); done(response) gets the final response object
class responses_events : public answer_events {
  public:
    responses_events(const openai_format & f, const job & j, response_meta m,
                     std::function<void(const nlohmann::json &)> done);
    bool take(job & j, std::string & out) override;

  private:
    void send(std::string & out, const std::string & type, nlohmann::json data);
    void on_delta(std::string & out, const nlohmann::json & delta);
    void open_message(std::string & out);
    void close_message(std::string & out);
    void close_calls(std::string & out);
    nlohmann::json snapshot(const std::string & status) const;

    completion_events chunks_;
    response_meta m_;
    std::function<void(const nlohmann::json &)> done_;
    int64_t seq_ = 0;
    bool started_ = false;
    nlohmann::json output_ = nlohmann::json::array();  // the items so far
    int64_t message_at_ = -1;                          // the open message item's index in output_
    std::vector<int64_t> call_at_;                     // each tool call's index in output_ (by the call's index)
    std::string finish_;
    nlohmann::json usage_, kvblend_;
};

}  // namespace kvblend
