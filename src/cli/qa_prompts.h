// question-answer prompts, one JSON object a line ({"system", "chunks",
// "query", "answer"}: the testbed's format), read by bench accuracy and calibrate
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace kvblend::cli {

struct qa_prompt {
    std::string system, query, answer;
    std::vector<std::string> chunks;
    std::string kind;  // optional "kind" field, for a breakdown
    int64_t line = 0;
};

// the prompts of a JSONL file (answers required or not); a malformed line is an
// error naming it, and a file without prompts an error too
std::vector<qa_prompt> read_prompts(const std::string & path, bool need_answers);

}  // namespace kvblend::cli
