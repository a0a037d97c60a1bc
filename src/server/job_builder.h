// requests become jobs here: a body checked for its endpoint (server_request.h)
// and against the context, the prompt rendered with the chat template (or the
// tool-call code) and tokenized, documents laid out for fusion (given as texts,
// by id from the store, or known ones found inside a plain prompt; a long plain
// prompt cut into chunks), and the sampling and output rules read. A request
// that cannot be served as sent throws request_error; nothing here runs the model.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "chat/tool_chat.h"
#include "kvblend/model.h"
#include "kvblend/server.h"
#include "server/doc_index.h"
#include "server/server_job.h"
#include "server/server_request.h"
#include "server/soft_store.h"

namespace kvblend {

class job_builder {
  public:
    // st: the server's store (null: none); documents by id and learning need
    // one. tiers: the hot chunks in front of it (a document's tokens by id)
    job_builder(std::shared_ptr<const model> m, const server_params & p, soft_store * st, chunk_tiers * tiers);
    ~job_builder();

    // the body, checked for its endpoint and for a text the context cannot hold
    nlohmann::json parse_body(const std::string & body, request_kind kind, bool * stream = nullptr) const;
    // … an already parsed body (one another API's body was read into)
    nlohmann::json check_body(nlohmann::json body, request_kind kind, bool * stream = nullptr) const;
    // the jobs of checked bodies: POST /v1/chat/completions and /v1/completions
    // count_only: the prompt's tokens only (no sampling rules, no bound on the answer's room)
    std::shared_ptr<job> chat_job(const nlohmann::json & b, bool count_only = false) const;
    std::shared_ptr<job> completion_job(const nlohmann::json & b) const;
    // one job per prompt of a body whose 'prompt' is an array (one for a string)
    std::vector<std::shared_ptr<job>> completion_jobs(const nlohmann::json & b) const;
    // POST /v1/documents (b: its body as parse_body checked it): collect and
    // store each document; texts: theirs, in order
    std::shared_ptr<job> ingest_job(const nlohmann::json & b, std::vector<std::string> & texts) const;

    // the key a document's chunk is stored under (also its id in the API)
    std::string doc_key(const std::vector<llama_token> & tokens) const;
    // a document the server was given: plain prompts that contain its text
    // reuse it, on every server of the store (a record in its documents log
    // when the text is new here)
    void remember(const std::string & text, const std::vector<llama_token> & tokens) const;
    // the documents other servers of the store were given since the last
    // read (at most every k_sync_ms; all: until the log is read to its end)
    void sync_known(bool all = false) const;
    size_t known_documents() const { return known_.size(); }

    static constexpr const char * k_docs_log = "documents";  // the store log of given documents' texts
    static constexpr double k_sync_ms = 200;

  private:
    // a template the jinja engine cannot read fails tool requests only, not the server
    void load_tool_templates();
    void read_sampling(const nlohmann::json & b, job & j, int64_t n_prompt, request_kind kind) const;
    void read_output_rules(const nlohmann::json & b, job & j, request_kind kind) const;
    // the slots hold dense caches (no --kv-codec): only these fuse documents
    bool dense_slots() const { return p_.kv_codec.empty(); }
    void require_dense_slots() const;
    void plain_or_chunked(job & j, std::vector<llama_token> tokens) const;
    bool with_known_docs(job & j, const std::string & text, const std::vector<std::string> & contents, int64_t n_tokens,
                         bool parse_special) const;
    std::vector<std::vector<llama_token>> read_documents(const nlohmann::json & d,
                                                         std::vector<std::pair<std::string, size_t>> & texts) const;
    std::shared_ptr<job> tool_chat_job(const nlohmann::json & b, const tool_request & tr,
                                       const std::vector<chat_message> & msgs, bool count_only) const;
    std::shared_ptr<tool_plan> tool_plan_of(const nlohmann::json & b, const tool_request & tr, size_t n_docs) const;
    std::vector<llama_token> stored_doc(const std::string & id) const;
    std::vector<llama_token> prompt_tokens(const nlohmann::json & ids_and_texts) const;

    std::shared_ptr<const model> m_;
    server_params p_;
    soft_store * st_;
    chunk_tiers * tiers_;
    mutable doc_index known_;               // texts of the documents plain prompts are searched for
    std::unique_ptr<log_writer> docs_log_;  // given documents' texts into the store's log (null: no store)
    mutable std::mutex sync_mu_;            // one reader of the documents log at a time
    mutable std::string docs_cursor_;       // … and where it is
    mutable double last_sync_ms_ = -1e300;
    std::unique_ptr<tool_templates> tool_tmpl_;  // the chat template as the tool-call code reads it (null: none)
    std::string tool_tmpl_error_;                // … or why it cannot be read
};

}  // namespace kvblend
