// constrained output: JSON schemas to GBNF by the pinned llama.cpp's converter
// (common/json-schema-to-grammar.cpp, compiled as kvblend_schema; the helpers
// of common.cpp it calls are in src/util/llama_common.cpp).
#include <algorithm>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <stdexcept>

#include "common.h"
#include "json-schema-to-grammar.h"
#include "kvblend/common.h"
#include "kvblend/sampler.h"
#include "llama-grammar.h"
#include "util/json_bounded.h"

namespace kvblend {

namespace {

// what libllama's parser would pay for a grammar's text, read outside
// literals, character classes and comments: its largest {m,n} count (the
// element is written out that many times, so 10^9 would take all memory before
// the first token) and its deepest nesting of groups (each level is a level of
// the parser's recursion: 30,000 overflowed an 8 MiB stack)
struct grammar_shape {
    uint64_t largest_repeat = 0;
    int64_t deepest_group = 0;
};

grammar_shape shape_of(const std::string & g) {
    grammar_shape s;
    int64_t depth = 0;
    for (size_t i = 0; i < g.size(); ++i) {
        const char c = g[i];
        if (c == '"' || c == '[') {  // a literal or a class: skip to its unescaped end
            const char end = c == '"' ? '"' : ']';
            for (++i; i < g.size() && g[i] != end; ++i)
                if (g[i] == '\\') ++i;
        } else if (c == '#') {
            while (i < g.size() && g[i] != '\n') ++i;
        } else if (c == '(') {
            s.deepest_group = std::max(s.deepest_group, ++depth);
        } else if (c == ')') {
            --depth;
        } else if (c >= '0' && c <= '9' && i > 0 && (g[i - 1] == '{' || g[i - 1] == ',')) {
            uint64_t n = 0;
            for (; i < g.size() && g[i] >= '0' && g[i] <= '9'; ++i)
                n = std::min<uint64_t>(n * 10 + (uint64_t) (g[i] - '0'), 1u << 30);
            s.largest_repeat = std::max(s.largest_repeat, n);
            --i;
        }
    }
    return s;
}

void check_shape(const std::string & grammar) {
    const grammar_shape s = shape_of(grammar);
    if (s.largest_repeat > k_max_grammar_repeat)
        throw error("the grammar repeats an element more than " + std::to_string(k_max_grammar_repeat) +
                    " times ({m,n}, or a schema's minItems/maxItems/minLength/maxLength)");
    if (s.deepest_group > k_max_grammar_nesting)
        throw error("the grammar nests groups " + std::to_string(s.deepest_group) + " deep, more than " +
                    std::to_string(k_max_grammar_nesting));
}

constexpr int k_max_schema_depth = k_max_json_depth;  // nesting a schema may have: the converter walks it recursively

// the schema as JSON, nested at most k_max_schema_depth deep
nlohmann::json parse_schema(const std::string & schema) {
    try {
        return json_parse_bounded(schema, k_max_schema_depth, "the JSON schema");
    } catch (const nlohmann::json::exception & e) {
        throw error(std::string("the JSON schema is not JSON: ") + e.what());
    }
}

// the converter turns a regex it cannot express into "any string" with only a
// warning on stderr: a schema that asked for a pattern would silently get none.
// each "pattern" is converted alone first; the fallback is a root that is a plain string
void check_patterns(const nlohmann::json & schema) {
    if (schema.is_array())
        for (const auto & x : schema) check_patterns(x);
    if (!schema.is_object()) return;
    for (const auto & [key, value] : schema.items()) {
        if (key == "pattern" && value.is_string()) {
            std::string alone;
            try {
                alone = json_schema_to_grammar(
                    common_json::parse(nlohmann::json{{"type", "string"}, {"pattern", value}}.dump()), true);
            } catch (const std::exception & e) {  // a malformed regex ("^[a-y)?$")
                std::string why = e.what();
                std::replace(why.begin(), why.end(), '\n', ' ');
                throw error("the JSON schema cannot be turned into a grammar: " + why);
            }
            if (("\n" + alone).find("\nroot ::= string\n") != std::string::npos)
                throw error("the JSON schema cannot be turned into a grammar: pattern " + value.get<std::string>() +
                            " uses regex syntax the converter cannot express");
        } else {
            check_patterns(value);
        }
    }
}

// the converter reads counts as int and bounds as int64: a number outside those
// (1e92 items) would be an undefined conversion, so it is an error here
void check_numbers(const nlohmann::json & schema) {
    if (schema.is_array())
        for (const auto & x : schema) check_numbers(x);
    if (!schema.is_object()) return;
    for (const auto & [key, value] : schema.items()) {
        if (!value.is_number()) {
            check_numbers(value);
            continue;
        }
        const double v = value.get<double>();
        const bool count = key == "minItems" || key == "maxItems" || key == "minLength" || key == "maxLength";
        const bool bound =
            key == "minimum" || key == "maximum" || key == "exclusiveMinimum" || key == "exclusiveMaximum";
        if ((count && !(v >= 0 && v <= 2147483647.0)) || (bound && !(v >= -9.2e18 && v <= 9.2e18)))
            throw error("the JSON schema's " + key + " is out of range: " + value.dump());
    }
}

}  // namespace

std::string grammar_from_json_schema(const std::string & schema) {
    const nlohmann::json parsed_schema = parse_schema(schema);
    check_numbers(parsed_schema);
    check_patterns(parsed_schema);
    common_json parsed;
    try {
        parsed = common_json::parse(schema);
    } catch (const std::exception & e) {
        throw error(std::string("the JSON schema is not JSON: ") + e.what());
    }
    std::string grammar;
    try {
        grammar = json_schema_to_grammar(parsed, true);
    } catch (const std::exception & e) {
        // the converter's message lists every part it could not express, one per line
        std::string why = e.what();
        std::replace(why.begin(), why.end(), '\n', ' ');
        throw error("the JSON schema cannot be turned into a grammar: " + why);
    }
    check_shape(grammar);
    return grammar;
}

namespace {

constexpr size_t k_grammar_quote_bytes = 80;  // of the grammar, what an error message quotes

// libllama's messages quote the grammar from where parsing stopped to its end
std::string bounded(std::string why) {
    if (why.size() > k_grammar_quote_bytes) why.resize(k_grammar_quote_bytes), why += "…";
    std::replace(why.begin(), why.end(), '\n', ' ');
    return why;
}

// a reference an alternative can begin with: its first element, or a later
// one after rules that can match nothing (as `empty` says which)
struct leading_ref {
    uint32_t to;
    bool leaves_rest;  // elements follow the reference in its alternative
};

// rule r -> the references its alternatives can begin with
std::vector<std::vector<leading_ref>> leading_refs(const llama_grammar_rules & rules, const std::vector<char> & empty) {
    const size_t n = rules.size();
    std::vector<std::vector<leading_ref>> next(n);
    for (size_t r = 0; r < n; ++r) {
        const std::vector<llama_grammar_element> & els = rules[r];
        bool leading = true;
        for (size_t i = 0; i < els.size() && els[i].type != LLAMA_GRETYPE_END; ++i) {
            const llama_grammar_element & e = els[i];
            if (e.type == LLAMA_GRETYPE_ALT) {
                leading = true;
            } else if (leading && e.type == LLAMA_GRETYPE_RULE_REF && e.value < n) {
                const bool last = els[i + 1].type == LLAMA_GRETYPE_ALT || els[i + 1].type == LLAMA_GRETYPE_END;
                next[r].push_back({e.value, !last});
                leading = empty[e.value];
            } else {
                leading = false;
            }
        }
    }
    return next;
}

// the longest chain of rules each of which can begin with the next (its first
// element, or a later one after rules with an empty alternative): libllama's
// left-recursion check walks such chains recursively when it builds the
// sampler, so a chain of 100,000 overflowed an 8 MiB stack. throws when a rule
// can so begin with itself (left recursion, which libllama refuses after
// walking the chain). computed without recursion
int64_t longest_leading_chain(const llama_grammar_rules & rules) {
    const size_t n = rules.size();
    // a rule's elements: its alternatives, each ended by ALT, the last by END
    auto ends_alternative = [](const llama_grammar_element & e) {
        return e.type == LLAMA_GRETYPE_ALT || e.type == LLAMA_GRETYPE_END;
    };
    // a rule with an empty alternative, as libllama's left-recursion check reads
    // "can match nothing" (not through other rules: "(x? y?)+" is no left recursion to it)
    std::vector<char> empty(n, 0);
    for (size_t r = 0; r < n; ++r) {
        bool at_start = true;
        for (const llama_grammar_element & e : rules[r]) {
            if (ends_alternative(e) && at_start) empty[r] = 1;
            if (empty[r] || e.type == LLAMA_GRETYPE_END) break;
            at_start = ends_alternative(e);
        }
    }
    const std::vector<std::vector<leading_ref>> next = leading_refs(rules, empty);
    std::vector<int64_t> into(n, 0);
    for (const auto & refs : next)
        for (const leading_ref & e : refs) into[e.to]++;
    // the longest path, rules taken in topological order
    std::vector<uint32_t> ready;
    for (size_t r = 0; r < n; ++r)
        if (into[r] == 0) ready.push_back((uint32_t) r);
    std::vector<int64_t> depth(n, 1);
    int64_t longest = n > 0 ? 1 : 0;
    size_t done = 0;
    while (!ready.empty()) {
        const uint32_t r = ready.back();
        ready.pop_back();
        ++done;
        for (const leading_ref & e : next[r]) {
            const uint32_t b = e.to;
            depth[b] = std::max(depth[b], depth[r] + 1);
            longest = std::max(longest, depth[b]);
            if (--into[b] == 0) ready.push_back(b);
        }
    }
    if (done < n) throw error("the grammar is left-recursive: a rule can begin with itself");
    return longest;
}

// the rules that can match nothing, through other rules too (a fixpoint)
std::vector<char> nullable_rules(const llama_grammar_rules & rules) {
    const size_t n = rules.size();
    std::vector<char> empty(n, 0);
    for (bool grew = true; grew;) {
        grew = false;
        for (size_t r = 0; r < n; ++r) {
            if (empty[r]) continue;
            bool all_empty = true;  // so far in this alternative
            for (const llama_grammar_element & e : rules[r]) {
                if (e.type == LLAMA_GRETYPE_ALT || e.type == LLAMA_GRETYPE_END) {
                    if (all_empty) {
                        empty[r] = 1;
                        grew = true;
                        break;
                    }
                    if (e.type == LLAMA_GRETYPE_END) break;
                    all_empty = true;
                } else {
                    all_empty = all_empty && e.type == LLAMA_GRETYPE_RULE_REF && e.value < n && empty[e.value];
                }
            }
        }
    }
    return empty;
}

// libllama expands the rule at the top of a parse stack into each of its
// alternatives, and drops a stack it has seen: a rule that can begin with
// itself (after rules that match nothing) comes back to the same stack when
// every step of the cycle is the last element of its alternative, and ends;
// when one step leaves an element behind, each turn of the cycle grows the
// stack, and sampling never returns (one request held a slot forever). such
// a cycle is refused; the ones that end ("(x? y)+") are not
void check_no_growing_left_cycle(const llama_grammar_rules & rules, const std::map<std::string, uint32_t> & ids) {
    const size_t n = rules.size();
    const std::vector<std::vector<leading_ref>> next = leading_refs(rules, nullable_rules(rules));
    // strongly connected components (Tarjan's, with an explicit stack)
    std::vector<int64_t> index(n, -1), low(n, 0), comp(n, -1);
    std::vector<uint32_t> open;  // visited, not yet in a component
    std::vector<char> on_open(n, 0);
    int64_t counter = 0, n_comp = 0;
    for (size_t root = 0; root < n; ++root) {
        if (index[root] >= 0) continue;
        std::vector<std::pair<uint32_t, size_t>> walk = {{(uint32_t) root, 0}};  // (rule, next edge to follow)
        index[root] = low[root] = counter++;
        open.push_back((uint32_t) root);
        on_open[root] = 1;
        while (!walk.empty()) {
            auto & [r, at] = walk.back();
            if (at < next[r].size()) {
                const uint32_t b = next[r][at++].to;
                if (index[b] < 0) {
                    index[b] = low[b] = counter++;
                    open.push_back(b);
                    on_open[b] = 1;
                    walk.push_back({b, 0});
                } else if (on_open[b]) {
                    low[r] = std::min(low[r], index[b]);
                }
                continue;
            }
            const uint32_t done = r;
            walk.pop_back();
            if (!walk.empty()) low[walk.back().first] = std::min(low[walk.back().first], low[done]);
            if (low[done] == index[done]) {
                for (uint32_t x = UINT32_MAX; x != done;) {
                    x = open.back();
                    open.pop_back();
                    on_open[x] = 0;
                    comp[x] = n_comp;
                }
                ++n_comp;
            }
        }
    }
    for (size_t r = 0; r < n; ++r)
        for (const leading_ref & e : next[r]) {
            if (comp[e.to] != comp[r] || !e.leaves_rest) continue;
            std::string name = "?";
            for (const auto & [nm, id] : ids)
                if (id == r) name = nm;
            throw error("the grammar is left-recursive: rule '" + bounded(name) +
                        "' can begin with itself after rules that match nothing");
        }
}

// the grammar through libllama's own parser, rule by rule: its parse() prints a
// failing grammar whole on stderr (megabytes into a server's log), so the
// sampler only ever sees one that parses. parse() skips space and comments, reads
// rules to the end, then checks that each rule referred to is defined.
void parse_quietly(const llama_vocab * vocab, const std::string & grammar) {
    llama_grammar_parser parser(vocab);
    auto skip_space = [](const char * p) {
        while (*p == ' ' || *p == '\t' || *p == '\r' || *p == '\n' || *p == '#')
            if (*p == '#')
                while (*p && *p != '\r' && *p != '\n') ++p;
            else
                ++p;
        return p;
    };
    try {
        for (const char * pos = skip_space(grammar.c_str()); *pos;) pos = parser.parse_rule(pos);
    } catch (const std::exception & e) {
        throw error("the grammar is not valid GBNF: " + bounded(e.what()));
    }
    for (const auto & [name, id] : parser.symbol_ids)
        if (id >= parser.rules.size() || parser.rules[id].empty())
            throw error("the grammar is not valid GBNF: rule '" + bounded(name) + "' is used but not defined");
    if (!parser.symbol_ids.count("root")) throw error("the grammar has no 'root' rule");
    check_no_growing_left_cycle(parser.rules, parser.symbol_ids);
    const int64_t chain = longest_leading_chain(parser.rules);
    if (chain > k_max_grammar_chain)
        throw error("the grammar has a chain of " + std::to_string(chain) +
                    " rules each beginning with the next, more than " + std::to_string(k_max_grammar_chain));
}

}  // namespace

void grammar_check(const llama_vocab * vocab, const std::string & grammar) {
    if (grammar.empty()) throw error("the grammar is empty");
    check_shape(grammar);
    parse_quietly(vocab, grammar);
    std::unique_ptr<llama_sampler, decltype(&llama_sampler_free)> g(
        llama_sampler_init_grammar(vocab, grammar.c_str(), "root"), &llama_sampler_free);
    if (!g) throw error("the grammar is not valid GBNF with a 'root' rule");
}

}  // namespace kvblend
