// constrained output and log-probabilities in the sampler: a grammar built from
// a JSON schema keeps even random logits inside the schema, and the reported
// probabilities are the log-softmax of what the sampler saw after the grammar.
#include <gtest/gtest.h>
#include <pthread.h>

#include <cctype>
#include <cmath>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <utility>

#include "kvblend/common.h"
#include "kvblend/sampler.h"
#include "kvblend/vocab.h"

namespace kvblend {
namespace {

using json = nlohmann::json;

const vocab & stories_vocab() {
    static vocab v(std::string(KVBLEND_TEST_MODELS) + "/stories260K.gguf");
    return v;
}

std::vector<float> random_logits(std::mt19937 & rng, int32_t n) {
    std::normal_distribution<float> d(0.0f, 3.0f);
    std::vector<float> l(n);
    for (float & x : l) x = d(rng);
    return l;
}

// sample from fresh random logits each step until an end-of-generation token or max_tokens
std::string run(sampler & smp, uint32_t seed, int max_tokens, bool * ended = nullptr) {
    const vocab & v = stories_vocab();
    std::mt19937 rng(seed);
    std::string text;
    if (ended) *ended = false;
    for (int i = 0; i < max_tokens; ++i) {
        const std::vector<float> l = random_logits(rng, v.n_tokens());
        const llama_token tok = smp.sample(l.data(), v.n_tokens());
        if (v.is_eog(tok)) {
            if (ended) *ended = true;
            break;
        }
        text += v.token_to_piece(tok);
    }
    return text;
}

const char * k_schema = R"({"type": "object",
    "properties": {"color": {"enum": ["red", "green"]}, "ok": {"type": "boolean"},
                   "n": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["color", "ok", "n"], "additionalProperties": false})";

TEST(grammar, a_schema_keeps_random_logits_inside_it) {
    const std::string g = grammar_from_json_schema(k_schema);
    for (uint32_t seed = 1; seed <= 6; ++seed) {
        sampler_params sp;
        sp.temp = 1.0f;
        sp.top_k = 0, sp.top_p = 1.0f, sp.min_p = 0.0f;
        sp.seed = seed;
        sp.grammar = g;
        sampler smp(sp, stories_vocab().raw());
        bool ended = false;
        const std::string text = run(smp, seed, 400, &ended);
        EXPECT_TRUE(ended) << "seed " << seed << ": " << text;
        const json out = json::parse(text, nullptr, false);
        ASSERT_TRUE(out.is_object()) << text;
        EXPECT_EQ(out.size(), 3u) << text;
        EXPECT_TRUE(out["color"] == "red" || out["color"] == "green") << text;
        EXPECT_TRUE(out["ok"].is_boolean()) << text;
        ASSERT_TRUE(out["n"].is_number_integer()) << text;
        EXPECT_GE(out["n"].get<int>(), 0);
        EXPECT_LE(out["n"].get<int>(), 99);
    }
    // the same logits without the grammar are no JSON at all (the check above can fail)
    sampler_params free_sp;
    free_sp.temp = 1.0f;
    free_sp.seed = 1;
    sampler free_smp(free_sp, stories_vocab().raw());
    EXPECT_TRUE(json::parse(run(free_smp, 1, 60), nullptr, false).is_discarded());
}

TEST(grammar, a_grammar_that_cannot_finish_stops_at_the_token_limit) {
    sampler_params sp;
    sp.grammar = R"(root ::= "a"{1000})";                      // longer than 20 tokens can write
    sp.logit_bias.push_back({stories_vocab().eos(), 100.0f});  // the end is what the model wants most
    sampler smp(sp, stories_vocab().raw());
    bool ended = true;
    const std::string text = run(smp, 3, 20, &ended);
    EXPECT_FALSE(ended);  // the end is forbidden until the grammar is complete
    EXPECT_FALSE(text.empty());
    EXPECT_EQ(text.find_first_not_of('a'), std::string::npos) << text;
}

TEST(grammar, bad_grammars_and_schemas_are_errors_that_say_why) {
    const llama_vocab * v = stories_vocab().raw();
    EXPECT_NO_THROW(grammar_check(v, R"(root ::= "x" [0-9]{1,3})"));
    for (const char * bad : {"root ::= undefined", "item ::= \"x\"", "root ::= (", "", "root ::= \"a\"{5000}",
                             "root ::= [a]{0,99999999999}"})
        EXPECT_THROW(grammar_check(v, bad), error) << bad;
    // a brace inside a literal is no repetition
    EXPECT_NO_THROW(grammar_check(v, R"(root ::= "{99999}" "x")"));
    for (const char * bad :
         {"{not json", R"({"type": "string", "pattern": "^(?=a)$"})", R"({"type": "string", "pattern": "^[a-y)?$"})",
          R"({"$ref": "#/definitions/none"})", R"({"type": "array", "items": {"type": "integer"}, "minItems": 100000})",
          R"({"type": "string", "maxLength": 1000000})",
          // counts and bounds the converter cannot hold (an undefined conversion before)
          R"({"type": "array", "items": {"enum": ["a"]}, "minItems": 1.3e92})",
          R"({"type": "string", "maxLength": -1})", R"({"type": "integer", "minimum": 1e300})"}) {
        try {
            grammar_from_json_schema(bad);
            ADD_FAILURE() << "accepted " << bad;
        } catch (const error & e) {
            EXPECT_NE(std::string(e.what()).find("schema"), std::string::npos) << e.what();
        }
    }
    sampler_params sp;
    sp.grammar = "root ::= (";
    sampler smp(sp, v);
    std::vector<float> l(stories_vocab().n_tokens(), 0.0f);
    EXPECT_THROW(smp.sample(l.data(), (int32_t) l.size()), error);
    EXPECT_THROW(sampler no_vocab(sp), error);  // a grammar without the vocabulary
}

// a failing grammar is one short message: libllama's parser printed the whole
// grammar on stderr (an 8 MB grammar, 7 MB in a server's log even with --quiet)
TEST(grammar, a_failing_grammar_is_quoted_only_in_part) {
    const llama_vocab * v = stories_vocab().raw();
    const std::string body(1 << 20, 'a');
    for (const std::string & bad : {"root ::= \"" + body, "root ::= x\nx ::= " + body + " (", "root ::= " + body,
                                    "# " + body + "\nroot ::= \"a\" )", "item ::= \"" + body + "\""}) {
        testing::internal::CaptureStderr();
        std::string why;
        try {
            grammar_check(v, bad);
        } catch (const error & e) {
            why = e.what();
        }
        const std::string printed = testing::internal::GetCapturedStderr();
        EXPECT_FALSE(why.empty()) << bad.substr(0, 40);
        EXPECT_LT(why.size(), 200u) << why.substr(0, 300);
        EXPECT_LT(printed.size(), 1000u) << printed.substr(0, 300);
    }
    // the check is libllama's own parse: what it takes, the sampler takes
    EXPECT_NO_THROW(
        grammar_check(v, "# a comment\n\nroot ::= x | y # and another\r\nx ::= \"" + body + "\"\ny ::= [a-z]+\n"));
}

// libllama's parser recurses once per nested group and its sampler once per rule
// of a chain each beginning with the next: 30,000 groups and a chain of 100,000
// rules each killed the process (a stack overflow from one request). Both are
// refused first; what stays under the bounds runs, on a 2 MiB stack too
TEST(grammar, deep_groups_and_long_rule_chains_are_refused_before_libllama_walks_them) {
    const llama_vocab * v = stories_vocab().raw();
    auto groups = [](int64_t n) {
        return "root ::= " + std::string((size_t) n, '(') + "\"a\"" + std::string((size_t) n, ')');
    };
    auto chain = [](int64_t n, bool through_empty) {
        std::string g = "root ::= r0\nn ::= \"\"\n";
        for (int64_t i = 0; i < n; ++i)
            g += "r" + std::to_string(i) + " ::= " + (through_empty ? "n " : "") + "r" + std::to_string(i + 1) + "\n";
        return g + "r" + std::to_string(n) + " ::= \"a\"\n";
    };
    const std::pair<std::string, const char *> refused[] = {
        {groups(30000), "nests groups 30000 deep"},
        {groups(k_max_grammar_nesting + 1), "nests groups"},
        {chain(100000, false), "a chain of 100002 rules"},
        {chain(100000, true), "a chain of"},  // each rule begins with the next after one that matches nothing
        {"root ::= n root \"a\" | \"a\"\nn ::= \"b\" | \n", "left-recursive"},
        // the same through a rule that matches nothing only through another one:
        // libllama's own check misses it, and sampling under it never returned
        {"root ::= n root \"a\" | \"a\"\nn ::= \"b\"?\n", "rule 'root' can begin with itself"},
        {"root ::= x \"!\"\nx ::= (\"b\"?) y \"c\" | \"d\"\ny ::= (\"e\"?) x\n", "left-recursive"},
    };
    for (const auto & [g, why] : refused) {
        try {
            grammar_check(v, g);
            ADD_FAILURE() << "accepted " << g.substr(0, 60);
        } catch (const error & e) {
            EXPECT_NE(std::string(e.what()).find(why), std::string::npos) << e.what();
        }
    }
    // under the bounds: checked (which builds libllama's sampler) on a thread with a 2 MiB stack
    const std::string ok[] = {groups(k_max_grammar_nesting), chain(k_max_grammar_chain - 3, true),
                              "root ::= \"a\" root | \"a\"\n",
                              // no left recursion to libllama: the group can match nothing only through other rules
                              "root ::= (x? y)+\nx ::= \"a\"\ny ::= | \" \"\n"};
    for (const std::string & g : ok) {
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setstacksize(&attr, 2u << 20);
        struct job {
            const llama_vocab * v;
            const std::string * g;
            std::string err;
        } j{v, &g, {}};
        pthread_t t;
        ASSERT_EQ(pthread_create(
                      &t, &attr,
                      [](void * p) -> void * {
                          auto * jj = static_cast<job *>(p);
                          try {
                              grammar_check(jj->v, *jj->g);
                          } catch (const std::exception & e) {
                              jj->err = e.what();
                          }
                          return nullptr;
                      },
                      &j),
                  0);
        pthread_join(t, nullptr);
        pthread_attr_destroy(&attr);
        EXPECT_EQ(j.err, "") << g.substr(0, 60);
    }
}

// the log-softmax of a row, by hand
std::vector<double> log_softmax(const std::vector<float> & l) {
    double mx = -INFINITY, sum = 0;
    for (float x : l) mx = std::max(mx, (double) x);
    for (float x : l) sum += std::exp(x - mx);
    std::vector<double> out;
    for (float x : l) out.push_back(x - mx - std::log(sum));
    return out;
}

TEST(logprobs, are_the_log_softmax_of_the_logits_with_the_best_candidates) {
    const int32_t n = stories_vocab().n_tokens();
    std::mt19937 rng(7);
    const std::vector<float> l = random_logits(rng, n);
    const std::vector<double> want = log_softmax(l);
    sampler_params sp;
    sp.temp = 0.8f;
    sp.top_k = 5;  // sampling truncation does not change what is reported
    sp.seed = 3;
    sp.logprobs = true;
    sp.n_probs = 5;
    sampler smp(sp, stories_vocab().raw());
    const llama_token tok = smp.sample(l.data(), n);
    const sampled_token & s = smp.last();
    EXPECT_EQ(s.token, tok);
    EXPECT_NEAR(s.logprob, want[tok], 1e-4);
    ASSERT_EQ(s.top.size(), 5u);
    std::vector<int> order(n);
    for (int i = 0; i < n; ++i) order[i] = i;
    std::partial_sort(order.begin(), order.begin() + 5, order.end(), [&](int a, int b) { return l[a] > l[b]; });
    for (int i = 0; i < 5; ++i) {
        EXPECT_EQ(s.top[i].token, order[i]);
        EXPECT_NEAR(s.top[i].logprob, want[order[i]], 1e-4);
    }
}

TEST(logprobs, are_taken_after_the_grammar) {
    const vocab & v = stories_vocab();
    const int32_t n = v.n_tokens();
    std::mt19937 rng(11);
    const std::vector<float> l = random_logits(rng, n);
    sampler_params sp;
    sp.grammar = R"(root ::= [0-9]+)";
    sp.logprobs = true;
    sp.n_probs = 20;
    sampler smp(sp, v.raw());
    const llama_token tok = smp.sample(l.data(), n);
    const sampled_token & s = smp.last();
    ASSERT_FALSE(s.top.empty());
    EXPECT_EQ(s.top[0].token, tok);  // greedy: the best allowed candidate
    double mass = 0;
    for (const token_logprob & c : s.top) {
        const std::string piece = v.token_to_piece(c.token);
        ASSERT_FALSE(piece.empty());
        EXPECT_EQ(piece.find_first_not_of("0123456789"), std::string::npos) << piece;
        mass += std::exp(c.logprob);
    }
    // the grammar's tokens share all the probability: renormalised among them
    EXPECT_GT(mass, 0.5);
    EXPECT_LE(mass, 1.0 + 1e-4);
    // fewer allowed tokens than asked for: only they are listed (the forbidden
    // ones came after them with "logprob": null)
    sp.grammar = R"(root ::= "a" | "b")";
    sampler two(sp, v.raw());
    two.sample(l.data(), n);
    ASSERT_FALSE(two.last().top.empty());
    EXPECT_LT(two.last().top.size(), 20u);
    for (const token_logprob & c : two.last().top) {
        EXPECT_TRUE(std::isfinite(c.logprob)) << c.token;
        const std::string piece = v.token_to_piece(c.token);
        EXPECT_TRUE(piece == "a" || piece == "b") << piece;
    }
    EXPECT_THROW(
        [] {
            sampler_params bad;
            bad.n_probs = k_max_probs + 1;
            sampler x(bad);
        }(),
        error);
}

// logits that make tok the choice (a peak over random values)
std::vector<float> peaked_logits(std::mt19937 & rng, int32_t n, llama_token tok) {
    std::vector<float> l = random_logits(rng, n);
    l[tok] = 100.0f;
    return l;
}

// a lazy grammar (tool calls under tool_choice "auto") leaves the text free
// until its trigger appears, then binds the rest from the trigger on
TEST(grammar, a_lazy_grammar_binds_from_its_trigger_on) {
    const vocab & v = stories_vocab();
    const std::string grammar = R"(root ::= "<call>" [0-9] [0-9] [0-9] "</call>")";
    for (uint32_t seed = 1; seed <= 4; ++seed) {
        sampler_params sp;
        sp.temp = 1.0f;
        sp.top_k = 0, sp.top_p = 1.0f, sp.min_p = 0.0f;
        sp.seed = seed;
        sp.grammar = grammar;
        sp.grammar_lazy = true;
        sp.grammar_trigger_patterns = {"<call>"};
        sampler smp(sp, v.raw());
        std::mt19937 rng(seed);
        // free text the grammar would refuse, then the trigger: both sampled as forced
        std::string text;
        for (llama_token t : v.tokenize("Once there was <call>", false)) {
            const std::vector<float> l = peaked_logits(rng, v.n_tokens(), t);
            ASSERT_EQ(smp.sample(l.data(), v.n_tokens()), t);
            text += v.token_to_piece(t);
        }
        bool ended = false;
        text += run(smp, seed, 40, &ended);
        EXPECT_TRUE(ended) << text;
        const size_t at = text.find("<call>");
        ASSERT_NE(at, std::string::npos) << text;
        const std::string call = text.substr(at + 6);
        EXPECT_EQ(call.size(), 10u) << text;
        EXPECT_TRUE(call.size() >= 3 && std::isdigit((unsigned char) call[0]) &&
                    std::isdigit((unsigned char) call[1]) && std::isdigit((unsigned char) call[2]))
            << text;
        EXPECT_EQ(call.substr(3), "</call>") << text;
    }
    // the same first tokens under the grammar bound from the start: refused
    sampler_params eager;
    eager.grammar = grammar;
    sampler smp(eager, v.raw());
    std::mt19937 rng(1);
    const llama_token first = v.tokenize("Once", false)[0];
    const std::vector<float> l = peaked_logits(rng, v.n_tokens(), first);
    EXPECT_NE(smp.sample(l.data(), v.n_tokens()), first);
    // a lazy grammar without a trigger is an error, not a grammar that never binds
    sampler_params none;
    none.grammar = grammar;
    none.grammar_lazy = true;
    sampler bad(none, v.raw());
    EXPECT_THROW(bad.sample(l.data(), v.n_tokens()), error);
}

// a tool-call grammar begins with the template's generation prompt, which is in
// the prompt already: the grammar reads it first and the answer starts after it
TEST(grammar, prefill_tokens_are_read_before_the_first_sampled_one) {
    const vocab & v = stories_vocab();
    sampler_params sp;
    sp.temp = 1.0f;
    sp.seed = 3;
    sp.grammar_prefill = v.tokenize("Once upon", false);
    std::string prefill_text;  // as the vocabulary writes it (a leading space, say)
    for (llama_token t : sp.grammar_prefill) prefill_text += v.token_to_piece(t);
    sp.grammar = "root ::= \"" + prefill_text + "\" \" \" [0-9] [0-9]";
    sampler smp(sp, v.raw());
    bool ended = false;
    const std::string text = run(smp, 3, 10, &ended);
    EXPECT_TRUE(ended) << text;
    ASSERT_EQ(text.size(), 3u) << text;
    EXPECT_TRUE(text[0] == ' ' && std::isdigit((unsigned char) text[1]) && std::isdigit((unsigned char) text[2]))
        << text;
    // prefill tokens the grammar cannot read are an error
    sp.grammar_prefill = v.tokenize("Twice", false);
    sampler bad(sp, v.raw());
    std::mt19937 rng(1);
    const std::vector<float> l = random_logits(rng, v.n_tokens());
    EXPECT_THROW(bad.sample(l.data(), v.n_tokens()), error);
}

}  // namespace
}  // namespace kvblend
