// libllama's tokenizer counts bytes and tokens in int32: texts and token
// lists past that are refused with an error, not wrapped to a negative length
#include <gtest/gtest.h>

#include <climits>
#include <string>
#include <vector>

#include "kvblend/common.h"
#include "kvblend/vocab.h"
#include "test_util.h"

namespace {

using kvblend::error;
using kvblend::vocab;

TEST(vocab, texts_and_token_lists_past_int32_are_refused) {
    const vocab v(kvblend::test::vocab_path("llama-spm"));
    // control: an ordinary text round-trips
    const std::vector<llama_token> t = v.tokenize("Tom had a red ball.", false);
    ASSERT_FALSE(t.empty());
    EXPECT_EQ(v.detokenize(t), "Tom had a red ball.");

    // one byte past the longest text libllama can count (2 GiB)
    {
        const std::string big((size_t) INT32_MAX - 7, 'a');
        try {
            (void) v.tokenize(big, false);
            ADD_FAILURE() << "a 2 GiB text was tokenized";
        } catch (const error & e) {
            EXPECT_NE(std::string(e.what()).find("too long to tokenize"), std::string::npos) << e.what();
        }
    }
    // a token list whose text could not be counted in int32
    {
        const std::vector<llama_token> many((size_t) INT32_MAX / 16 + 1, t[0]);
        try {
            (void) v.detokenize(many);
            ADD_FAILURE() << "134M tokens were detokenized into one buffer";
        } catch (const error & e) {
            EXPECT_NE(std::string(e.what()).find("too many to detokenize"), std::string::npos) << e.what();
        }
    }
}

}  // namespace
