// the fusion self-check at load (kvblend/self_check.h): every supported family
// passes it at every weight type, well inside its bounds, and a file our
// forward reads differently from libllama is refused with the reason
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "kvblend/model_maker.h"
#include "kvblend/self_check.h"
#include "test_util.h"

namespace kvblend {
namespace {

void expect_passes(const std::string & name, const std::shared_ptr<const model> & m) {
    const self_check_result r = fusion_self_check(m, {});
    std::printf("[ %s ] %s\n", name.c_str(), self_check_summary(r).c_str());
    EXPECT_TRUE(r.ok) << name << ": " << r.reason;
    // every step ran and measured something finite
    EXPECT_GE(r.forward_agree, k_self_check_bounds.forward_agree) << name;
    EXPECT_LE(r.forward_rel, k_self_check_bounds.forward_rel) << name;
    EXPECT_LE(r.rotation_rel, k_self_check_bounds.rotation_rel) << name;
    EXPECT_LE(r.placement_rel, k_self_check_bounds.placement_rel) << name;
    EXPECT_LE(r.ratio_one_rel, k_self_check_bounds.ratio_one_rel) << name;
    EXPECT_TRUE(r.ratio_kl >= 0 && std::isfinite(r.ratio_kl)) << name;
    EXPECT_GT(r.n_tokens, 8) << name;
}

// f32 weights are exact on both sides (forward_equiv); quantized ones round apart
TEST(self_check, every_family_passes_with_quantized_weights) {
    for (const char * preset : {"tiny-qwen3", "tiny-mistral3", "tiny-granite", "tiny-olmo2", "tiny-smollm3",
                                "tiny-phi3", "tiny-phi3-longrope", "tiny-mistral3-yarn", "tiny-gemma3", "tiny-gemma4",
                                "tiny-qwen3moe", "tiny-mixtral", "tiny-qwen2"})
        for (ggml_type wt : {GGML_TYPE_Q8_0, GGML_TYPE_Q4_0})
            expect_passes(std::string(preset) + ":" + ggml_type_name(wt),
                          model::load(test::make_test_model(preset, wt)));
}

TEST(self_check, the_trained_models_pass) {
    expect_passes("stories260K", model::load(test::stories_path()));
    expect_passes("testbed", model::load(test::testbed_path()));
}

// a file our forward reads differently from libllama: the same weights (same
// seed) loaded by us from one file and by libllama from another that differs
// in what a loader can misread. the loader once ignored the optional biases
// libllama reads; a RoPE base read wrong moves every rotation
TEST(self_check, a_file_read_differently_from_libllama_is_refused_with_the_reason) {
    model_spec biased = model_spec_preset("tiny-qwen2");
    biased.out_biases = true;
    model_spec other_base = model_spec_preset("tiny-qwen2");
    other_base.rope_base *= 100;
    for (const auto & [what, spec] : {std::pair{"biases", biased}, std::pair{"rope base", other_base}}) {
        make_model_params mp;
        mp.wtype = GGML_TYPE_F32;
        mp.vocab_from = test::default_vocab_for("tiny-qwen2");
        const std::string path = test::process_dir().file(std::string("tiny-qwen2-misread-") + what + ".gguf");
        make_model(spec, mp, path);
        self_check_params p;
        p.reference_path = path;
        const self_check_result r = fusion_self_check(model::load(test::make_test_model("tiny-qwen2")), p);
        std::printf("[ misread %s ] %s\n", what, self_check_summary(r).c_str());
        EXPECT_FALSE(r.ok) << what;
        EXPECT_NE(r.reason.find("differently from libllama"), std::string::npos) << r.reason;
        EXPECT_TRUE(r.forward_rel > k_self_check_bounds.forward_rel ||
                    r.forward_agree < k_self_check_bounds.forward_agree)
            << what;
        // the steps after it did not run, and say so
        EXPECT_LT(r.placement_rel, 0) << what;
        const nlohmann::json j = nlohmann::json::parse(self_check_json(r));
        EXPECT_FALSE(j["ok"].get<bool>());
        EXPECT_TRUE(j["placement_rel"].is_null());
        EXPECT_DOUBLE_EQ(j["forward_rel"].get<double>(), r.forward_rel);
    }
}

TEST(self_check, a_reference_libllama_cannot_read_is_a_failed_check_not_a_crash) {
    const test::temp_dir dir;
    const std::string junk = dir.file("not-a-model.gguf");
    std::ofstream(junk) << "GGUF but not really";
    self_check_params p;
    p.reference_path = junk;
    const self_check_result r = fusion_self_check(model::load(test::stories_path()), p);
    EXPECT_FALSE(r.ok);
    EXPECT_NE(r.reason.find("libllama cannot run this file"), std::string::npos) << r.reason;
}

// the verdict is kept per model, build and params: read back, not run again,
// until one of them changes; whatever else the folder holds is checked again
TEST(self_check, a_verdict_is_kept_per_model_and_params_and_damaged_ones_are_checked_again) {
    const test::temp_dir dir("verdicts");
    auto m = model::load(test::stories_path());
    const std::string file = dir.file(m->fingerprint() + ".json");
    const self_check_result first = fusion_self_check_cached(m, {}, dir.path().string());
    EXPECT_TRUE(first.ok && !first.cached);
    ASSERT_TRUE(std::filesystem::exists(file));
    const self_check_result again = fusion_self_check_cached(m, {}, dir.path().string());
    EXPECT_TRUE(again.ok && again.cached);
    EXPECT_EQ(self_check_json(again), self_check_json([&] {
                  self_check_result r = first;
                  r.cached = true;
                  return r;
              }()));
    EXPECT_NE(self_check_summary(again).find("kept from an earlier check"), std::string::npos);

    // other params are another verdict: checked, and kept in the model's one file
    self_check_params other;
    other.recomp_ratio = 0.3f;
    EXPECT_FALSE(fusion_self_check_cached(m, other, dir.path().string()).cached);
    EXPECT_TRUE(fusion_self_check_cached(m, other, dir.path().string()).cached);
    EXPECT_FALSE(fusion_self_check_cached(m, {}, dir.path().string()).cached);

    // a failed check is kept too, with its reason
    self_check_params misread;
    misread.reference_path = dir.file("missing.gguf");
    const self_check_result failed = fusion_self_check_cached(m, misread, dir.path().string());
    const self_check_result failed_again = fusion_self_check_cached(m, misread, dir.path().string());
    EXPECT_FALSE(failed.ok || failed.cached);
    EXPECT_TRUE(!failed_again.ok && failed_again.cached);
    EXPECT_EQ(failed_again.reason, failed.reason);

    // damaged, forged or foreign files: checked again and replaced
    const std::string key = nlohmann::json::parse(std::ifstream(file))["key"];
    const std::string good =
        nlohmann::json{{"key", key}, {"result", nlohmann::json::parse(self_check_json(failed))}}.dump();
    for (const std::string & bad :
         {std::string("not json"), good.substr(0, good.size() / 2), std::string(100000, '{'),
          nlohmann::json{{"key", key}, {"result", {{"ok", "yes"}, {"reason", ""}, {"n_tokens", 3}, {"ms", 1}}}}.dump(),
          nlohmann::json{{"key", key}, {"result", {{"ok", true}, {"reason", "why"}, {"n_tokens", 3}, {"ms", 1}}}}
              .dump(),
          nlohmann::json{{"key", "another build"}, {"result", nlohmann::json::parse(self_check_json(first))}}.dump(),
          nlohmann::json::array().dump()}) {
        std::ofstream(file, std::ios::trunc) << bad;
        const self_check_result r = fusion_self_check_cached(m, misread, dir.path().string());
        EXPECT_FALSE(r.cached) << bad.substr(0, 80);
        EXPECT_FALSE(r.ok);
        EXPECT_TRUE(fusion_self_check_cached(m, misread, dir.path().string()).cached) << bad.substr(0, 80);
    }

    // a folder that cannot be made: every load checks, nothing fails
    std::ofstream(dir.file("a-file")) << "x";
    const std::string nowhere = dir.file("a-file") + "/verdicts";
    EXPECT_TRUE(fusion_self_check_cached(m, {}, nowhere).ok);
    EXPECT_FALSE(fusion_self_check_cached(m, {}, nowhere).cached);
}

TEST(self_check, params_outside_a_blends_ranges_are_refused_before_any_work) {
    auto m = model::load(test::stories_path());
    self_check_params p;
    p.recomp_ratio = 1.5f;
    EXPECT_THROW(fusion_self_check(m, p), error);
    p.recomp_ratio = 0.08f;
    p.check_layer = 1000;
    EXPECT_THROW(fusion_self_check(m, p), error);
}

}  // namespace
}  // namespace kvblend
