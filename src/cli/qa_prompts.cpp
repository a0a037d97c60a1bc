#include "cli/qa_prompts.h"

#include <nlohmann/json.hpp>
#include <sstream>

#include "cli/cli_util.h"
#include "kvblend/common.h"

namespace kvblend::cli {

namespace {
constexpr uint64_t k_max_prompts_file = 1ull << 30;
}  // namespace

std::vector<qa_prompt> read_prompts(const std::string & path, bool need_answers) {
    // a regular file of bounded size (a fifo or /dev/zero is refused, not read forever)
    std::istringstream f(read_text_file(path, k_max_prompts_file));
    std::vector<qa_prompt> out;
    std::string line;
    int64_t ln = 0;
    auto bad = [&](const std::string & what) { throw error(path + ":" + std::to_string(ln) + ": " + what); };
    while (std::getline(f, line)) {
        ++ln;
        if (!line.empty() && line.back() == '\r') line.pop_back();
        if (line.find_first_not_of(" \t") == std::string::npos) continue;  // blank lines are allowed
        nlohmann::json j;
        try {
            j = nlohmann::json::parse(line);
        } catch (const nlohmann::json::exception & e) {  // a syntax error, or a number out of range
            bad(std::string("not valid JSON (") + e.what() + ")");
        }
        if (!j.is_object()) bad("expected a JSON object {\"system\", \"chunks\", \"query\", \"answer\"}");
        qa_prompt p;
        p.line = ln;
        auto text = [&](const char * key, bool required, std::string & to) {
            if (!j.contains(key)) {
                if (required) bad(std::string("missing \"") + key + "\"");
                return;
            }
            if (!j[key].is_string()) bad(std::string("\"") + key + "\" must be a string");
            to = j[key].get<std::string>();
        };
        text("system", false, p.system);
        text("query", true, p.query);
        text("answer", need_answers, p.answer);
        if (j.contains("kind") && j["kind"].is_string()) p.kind = j["kind"].get<std::string>();
        if (!j.contains("chunks")) bad("missing \"chunks\"");
        if (!j["chunks"].is_array() || j["chunks"].empty()) bad("\"chunks\" must be a non-empty array of strings");
        for (const auto & c : j["chunks"]) {
            if (!c.is_string()) bad("\"chunks\" must be a non-empty array of strings");
            p.chunks.push_back(c.get<std::string>());
        }
        if (p.query.empty()) bad("\"query\" is empty");
        out.push_back(std::move(p));
    }
    if (f.bad()) throw error("cannot read '" + path + "'");
    if (out.empty()) throw error("'" + path + "' holds no prompts");
    return out;
}

}  // namespace kvblend::cli
