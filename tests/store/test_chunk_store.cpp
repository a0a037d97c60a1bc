// the chunk store with its embedded directory backend: bit-exact roundtrips,
// corruption caught, LRU eviction, concurrent writers, blends from hits.
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <sys/wait.h>

#include <algorithm>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <thread>

#include "cli_run.h"
#include "kvblend/blend.h"
#include "kvblend/codec.h"
#include "kvblend/rag.h"
#include "kvblend/rag_prompt.h"
#include "kvblend/store.h"
#include "test_util.h"

namespace kvblend {
namespace {

namespace fs = std::filesystem;

const std::string k_stories = std::string(KVBLEND_TEST_MODELS) + "/stories260K.gguf";

std::vector<llama_token> doc_tokens(const model & m, int i) {
    const char * docs[] = {
        "Tom had a red ball. He liked to throw it high in the sky.",
        "Sue found a little cat in the garden. The cat was hungry.",
        "Lily had a big box of crayons. She drew a house and a tree.",
        "A small bird could not fly. Max helped the bird and kept it warm.",
    };
    return rag_doc_tokens(m.tokens(), docs[i % 4]);
}

fs::path entry_file(const test::temp_dir & d, const std::string & key) {
    return test::dir_entry_file(d.path(), key);
}

void expect_same_chunk(const chunk_kv & a, const chunk_kv & b) {
    EXPECT_EQ(a.tokens, b.tokens);
    EXPECT_EQ(a.pos0, b.pos0);
    EXPECT_EQ(a.type, b.type);
    ASSERT_EQ(a.bytes(), b.bytes());
    EXPECT_TRUE(std::equal(a.k(0), a.k(0) + a.bytes(), b.k(0)));  // bit-exact, every layer
}

TEST(chunk_store, dir_roundtrip_is_bit_exact) {
    auto m = model::load(k_stories);
    engine eng(m, engine_default_params());
    test::temp_dir d("store");
    auto st = store_open("dir:" + d.path().string());
    for (int i = 0; i < 3; ++i) {
        const chunk_kv c = collect(eng, doc_tokens(*m, i));
        const std::string key = chunk_key(*m, c.type, "raw", {}, c.tokens);
        EXPECT_EQ(key.size(), 32u);
        st->put(key, chunk_encode(*m, c, {}));
        EXPECT_TRUE(st->contains(key));
        const auto bytes = st->get(key);
        ASSERT_TRUE(bytes.has_value());
        expect_same_chunk(chunk_decode(*m, *bytes), c);
    }
    EXPECT_EQ(st->stats().n_entries, 3u);
    EXPECT_EQ(st->list().size(), 3u);
    // a bare path opens the same store
    EXPECT_EQ(store_open(d.path().string())->stats().n_entries, 3u);
}

TEST(chunk_store, keys_separate_models_types_prefixes_and_tokens) {
    auto m = model::load(k_stories);
    auto other = model::load(test::make_test_model("tiny"));
    const std::vector<llama_token> t = doc_tokens(*m, 0);
    const std::string base = chunk_key(*m, GGML_TYPE_F16, "raw", {}, t);
    EXPECT_NE(base, chunk_key(*other, GGML_TYPE_F16, "raw", {}, t));
    EXPECT_NE(base, chunk_key(*m, GGML_TYPE_F32, "raw", {}, t));
    EXPECT_NE(base, chunk_key(*m, GGML_TYPE_F16, "raw", {1}, t));
    EXPECT_NE(base, chunk_key(*m, GGML_TYPE_F16, "q8_0", {}, t));
    std::vector<llama_token> t2 = t;
    t2.back() ^= 1;
    EXPECT_NE(base, chunk_key(*m, GGML_TYPE_F16, "raw", {}, t2));
    EXPECT_EQ(base, chunk_key(*m, GGML_TYPE_F16, "raw", {}, t));
    // two quantizations of one synthetic model differ in fingerprint
    auto q8 = model::load(test::make_test_model("tiny", GGML_TYPE_Q8_0));
    EXPECT_NE(other->fingerprint(), q8->fingerprint());
}

TEST(chunk_store, corrupt_truncated_and_foreign_entries_are_misses) {
    auto m = model::load(k_stories);
    engine eng(m, engine_default_params());
    const std::vector<llama_token> toks = doc_tokens(*m, 1);
    const chunk_kv good = collect(eng, toks);
    const std::vector<uint8_t> bytes = chunk_encode(*m, good, {});

    auto expect_bad = [&](std::vector<uint8_t> b, const std::string & what) {
        EXPECT_NE(chunk_entry_check(b, m.get()).find(what), std::string::npos) << chunk_entry_check(b, m.get());
        EXPECT_THROW(chunk_decode(*m, b), error);
    };
    std::vector<uint8_t> flipped = bytes;
    flipped[bytes.size() / 2] ^= 0x40;
    expect_bad(flipped, "checksum");
    expect_bad(std::vector<uint8_t>(bytes.begin(), bytes.begin() + bytes.size() / 2), "truncated");
    expect_bad(std::vector<uint8_t>(bytes.begin(), bytes.begin() + 20), "truncated");
    std::vector<uint8_t> magic = bytes;
    magic[0] = 'X';
    expect_bad(magic, "magic");
    // a shape whose row size overflows (found by fuzz_store_entry): an error, not UB
    std::vector<uint8_t> huge = bytes;
    const uint32_t big[2] = {0xFC000002u, 0xFCFF000Fu};
    std::memcpy(&huge[52], big, 8);  // n_head_kv, head_dim
    expect_bad(huge, "too large");
    // an entry of another model: well formed, but not ours
    auto other = model::load(test::make_test_model("tiny"));
    engine eng2(other, engine_default_params());
    const std::vector<uint8_t> foreign = chunk_encode(*other, collect(eng2, {1, 2, 3, 4}), {});
    EXPECT_EQ(chunk_entry_check(foreign, nullptr), "");
    expect_bad(foreign, "another model");

    // through the store: the bad entry is removed and the chunk collected again
    test::temp_dir d("store");
    auto st = store_open(d.path().string());
    const std::string key = chunk_key(*m, good.type, "raw", {}, toks);
    for (const auto & bad : {flipped, std::vector<uint8_t>(bytes.begin(), bytes.begin() + 1000), foreign}) {
        st->put(key, bad);
        chunk_fetch_stats fs;
        const chunk_kv c = chunk_get_or_collect(st.get(), eng, {}, toks, fs);
        EXPECT_EQ(fs.misses, 1);
        EXPECT_EQ(fs.hits, 0);
        expect_same_chunk(c, good);
        // and the store now holds a good entry again
        EXPECT_EQ(chunk_entry_check(*st->get(key), m.get()), "");
    }
    // a file truncated on disk behind the store's back
    fs::resize_file(entry_file(d, key), 100);
    chunk_fetch_stats fs;
    expect_same_chunk(chunk_get_or_collect(st.get(), eng, {}, toks, fs), good);
    EXPECT_EQ(fs.misses, 1);
}

// a checksum is not a signature: whoever can write the store can write a
// well-formed entry that lies about what it holds. None of these is ever used
TEST(chunk_store, well_formed_entries_that_lie_are_refused) {
    auto m = model::load(k_stories);
    engine eng(m, engine_default_params());
    const std::vector<llama_token> toks = doc_tokens(*m, 1), other_toks = doc_tokens(*m, 2);
    const chunk_kv good = collect(eng, toks), other = collect(eng, other_toks);
    const std::string key = chunk_key(*m, good.type, "raw", {}, toks);
    const std::string other_key = chunk_key(*m, other.type, "raw", {}, other_toks);

    // token ids outside the vocabulary (the embedding would read past its rows)
    for (const llama_token bad : {(llama_token) m->hparams().n_vocab, (llama_token) 1000000, (llama_token) -7}) {
        chunk_kv c = good;
        c.tokens[1] = bad;
        const std::vector<uint8_t> b = chunk_encode(*m, c, {});
        EXPECT_NE(chunk_entry_check(b, m.get()).find("outside the model's vocabulary"), std::string::npos)
            << chunk_entry_check(b, m.get());
        EXPECT_THROW(chunk_decode(*m, b), error);
        // and a chunk built by a caller with such an id is refused by the blend, not fed to ggml
        std::vector<const chunk_kv *> ptrs = {&good, &c};
        EXPECT_THROW(blend(eng, ptrs, {1, 2}, blend_default_params()), error);
    }

    // another chunk's entry under this key: the key it derives is not its own
    const std::vector<uint8_t> swapped = chunk_encode(*m, other, {});
    EXPECT_EQ(chunk_entry_check(swapped, m.get(), other_key), "");
    EXPECT_NE(chunk_entry_check(swapped, m.get(), key).find("not of its own key"), std::string::npos);
    bool remove = false;
    EXPECT_THROW(chunk_decode_id(*m, std::vector<uint8_t>(swapped), key, &remove), error);
    EXPECT_TRUE(remove);
    EXPECT_EQ(chunk_decode_id(*m, std::vector<uint8_t>(swapped), other_key).tokens, other_toks);

    // an entry of another element type (f32) under the f16 key
    engine_params ep32 = engine_default_params();
    ep32.type_k = ep32.type_v = GGML_TYPE_F32;
    engine eng32(m, ep32);
    const std::vector<uint8_t> f32_entry = chunk_encode(*m, collect(eng32, toks), {});
    EXPECT_NE(chunk_entry_check(f32_entry, m.get(), key), "");

    // through the store: each is a miss, removed, and the chunk collected again
    test::temp_dir d("store");
    auto st = store_open(d.path().string());
    for (const auto & bad : {swapped, f32_entry}) {
        st->put(key, bad);
        chunk_fetch_stats fs;
        expect_same_chunk(chunk_get_or_collect(st.get(), eng, {}, toks, fs), good);
        EXPECT_EQ(fs.misses, 1);
        EXPECT_EQ(chunk_entry_check(*st->get(key), m.get(), key), "");
    }
    // an entry collected behind a prefix is not the chunk alone
    const chunk_kv behind = collect_after(eng, other_toks, toks);
    st->put(key, chunk_encode(*m, behind, other_toks));
    chunk_fetch_stats fs;
    expect_same_chunk(chunk_get_or_collect(st.get(), eng, {}, toks, fs), good);
    EXPECT_EQ(fs.misses, 1);

    // an evicted chunk's key names its eviction, which the entry does not hold:
    // refused as a document by id, but not marked for removal
    evict_params ev;
    ev.policy = EVICT_POLICY_SNAPKV;
    ev.budget_share = 0.5;
    const std::vector<uint8_t> sparse = chunk_encode(*m, collect_evicted(eng, toks, ev), {});
    remove = true;
    EXPECT_THROW(
        chunk_decode_id(*m, std::vector<uint8_t>(sparse), chunk_key(*m, good.type, "raw", {}, toks, ev), &remove),
        error);
    EXPECT_FALSE(remove);

    // codecs whose entry names only their family: the settings of the key come
    // from the payload, so an id is its document's whatever codec the caller
    // runs now, and another chunk's entry under it is found out
    for (const char * name : {"turboquant4", "turboquant3.5+qjl", "minicache:thr=0.45"}) {
        const std::unique_ptr<codec> cd = codec_by_name(name);
        const std::string own_key = chunk_key(*m, good.type, cd->name(), {}, toks);
        const std::vector<uint8_t> entry = chunk_encode(*m, good, {}, cd.get());
        EXPECT_EQ(chunk_entry_check(entry, m.get(), own_key), "") << name;
        EXPECT_EQ(chunk_decode_id(*m, std::vector<uint8_t>(entry), own_key).tokens, toks) << name;
        const std::vector<uint8_t> other_entry = chunk_encode(*m, other, {}, cd.get());
        remove = false;
        EXPECT_THROW(chunk_decode_id(*m, std::vector<uint8_t>(other_entry), own_key, &remove), error);
        EXPECT_TRUE(remove) << name;
        EXPECT_NE(chunk_entry_check(other_entry, m.get(), own_key).find("not of its own key"), std::string::npos)
            << name;
    }
}

TEST(chunk_store, lru_eviction_under_a_budget) {
    test::temp_dir d("store");
    const std::vector<uint8_t> blob(1000, 7);
    store_options so;
    so.max_bytes = 3500;  // room for three entries
    auto st = store_open(d.path().string(), so);
    const std::vector<std::string> keys = {"aaaa0000aaaa0000", "bbbb0000bbbb0000", "cccc0000cccc0000",
                                           "dddd0000dddd0000", "eeee0000eeee0000"};
    // age entries explicitly: a, b, c written at t = 100, 200, 300
    for (int i = 0; i < 3; ++i) {
        st->put(keys[i], blob);
        const timeval tv[2] = {{100 * (i + 1), 0}, {100 * (i + 1), 0}};
        utimes(entry_file(d, keys[i]).c_str(), tv);
    }
    st->get(keys[0]);  // a is used now: the least recently used is b
    st->put(keys[3], blob);
    EXPECT_TRUE(st->contains(keys[0]));
    EXPECT_FALSE(st->contains(keys[1]));
    EXPECT_TRUE(st->contains(keys[2]));
    EXPECT_TRUE(st->contains(keys[3]));
    st->put(keys[4], blob);  // now c (t = 300) is the oldest
    EXPECT_FALSE(st->contains(keys[2]));
    EXPECT_EQ(st->stats().n_entries, 3u);
    EXPECT_LE(st->stats().bytes, so.max_bytes);

    // gc with a smaller budget evicts more, oldest first
    store_options tight;
    tight.max_bytes = 1500;
    EXPECT_EQ(store_open(d.path().string(), tight)->gc(), 2u);
    EXPECT_EQ(st->list().size(), 1u);
    // eviction and erase remove the entries/XX folders they empty (each key here has its own)
    size_t folders = 0;
    for (const auto & e : std::filesystem::directory_iterator(d.path() / "entries")) {
        EXPECT_FALSE(std::filesystem::is_empty(e.path())) << e.path();
        ++folders;
    }
    EXPECT_EQ(folders, 1u);
    for (const auto & k : keys) st->erase(k);
    EXPECT_TRUE(std::filesystem::is_empty(d.path() / "entries"));
    st->put(keys[1], blob);  // a put makes its folder again
    EXPECT_TRUE(st->contains(keys[1]));
}

// the index is a summary anyone can edit: a wrong size in it never costs the
// valid entries, and a file too large to be an entry is not read into memory
TEST(chunk_store, a_forged_index_size_evicts_no_valid_entry) {
    test::temp_dir d("store");
    const std::vector<uint8_t> blob(1000, 7);
    store_options so;
    so.max_bytes = 3500;
    auto st = store_open(d.path().string(), so);
    const std::vector<std::string> keys = {"aaaa0000aaaa0000", "bbbb0000bbbb0000", "cccc0000cccc0000",
                                           "dddd0000dddd0000"};
    for (int i = 0; i < 3; ++i) {
        st->put(keys[i], blob);
        const timeval tv[2] = {{100 * (i + 1), 0}, {100 * (i + 1), 0}};
        utimes(entry_file(d, keys[i]).c_str(), tv);
    }
    {
        std::ofstream f(d.path() / "index", std::ios::trunc);
        f << "kvblend-store-index v1\n" << keys[0] << " 1000\n" << keys[1] << " 999999999999\n" << keys[2] << " 1000\n";
    }
    st->put(keys[3], blob);  // 4000 real bytes over 3500: only the oldest goes
    EXPECT_FALSE(st->contains(keys[0]));
    EXPECT_TRUE(st->contains(keys[1]));
    EXPECT_TRUE(st->contains(keys[2]));
    EXPECT_TRUE(st->contains(keys[3]));
    EXPECT_EQ(st->stats().bytes, 3000u);  // and the index holds the real sizes again

    // a sparse file far larger than the budget in an entry's place: a miss, not an allocation
    fs::resize_file(entry_file(d, keys[2]), 64ull << 30);
    EXPECT_FALSE(st->get(keys[2]).has_value());
    EXPECT_TRUE(st->get(keys[3]).has_value());
    auto unbounded = store_open(d.path().string());  // no budget: the fixed bound (16 GiB) holds
    EXPECT_FALSE(unbounded->get(keys[2]).has_value());
}

// a disk that fills while the index is written (here: a file size limit in a
// child process, so no root is needed): the put fails, and the index it would
// have replaced is whole, never a shorter one renamed into place
TEST(chunk_store, an_index_that_cannot_be_written_whole_is_not_replaced) {
    test::temp_dir d("store");
    auto st = store_open(d.path().string());
    std::vector<std::string> keys;
    for (int i = 0; i < 200; ++i) {
        char k[17];
        std::snprintf(k, sizeof(k), "%016x", 0x10000 + i);
        keys.push_back(k);
        st->put(k, std::vector<uint8_t>(100, (uint8_t) i));
    }
    const auto index_size = fs::file_size(d.path() / "index");
    ASSERT_GT(index_size, 4000u);
    const pid_t pid = fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
        signal(SIGXFSZ, SIG_IGN);  // a write past the limit fails with EFBIG instead
        const rlimit lim{4000, 4000};
        setrlimit(RLIMIT_FSIZE, &lim);
        int rc = 3;
        try {
            store_open(d.path().string())->put("ffff0000ffff0000", std::vector<uint8_t>(100, 1));
            rc = 0;  // reported as done
        } catch (const error & e) {
            rc = std::string(e.what()).find("index") != std::string::npos ? 1 : 2;
        }
        _exit(rc);
    }
    int status = 0;
    ASSERT_EQ(waitpid(pid, &status, 0), pid);
    ASSERT_TRUE(WIFEXITED(status));
    EXPECT_EQ(WEXITSTATUS(status), 1) << "the put should fail naming the index";
    EXPECT_EQ(fs::file_size(d.path() / "index"), index_size);
    EXPECT_EQ(st->stats().n_entries, 200u);
    for (const auto & e : fs::directory_iterator(d.path() / "tmp")) ADD_FAILURE() << "left behind: " << e.path();
}

TEST(chunk_store, bad_uris_and_keys_are_errors) {
    EXPECT_THROW(store_open(""), error);
    EXPECT_THROW(store_open("ftp://x"), error);
    EXPECT_THROW(store_open("dir:/proc/kvblend-cannot-create"), error);
    // a mistyped Redis URI is no folder of that name (whose name, password and all, stats would show)
    for (const char * typo : {"redis:/:SECRET@127.0.0.1", "redis:SECRET@h", "REDIS:/h", "rediss:h"}) {
        try {
            store_open(typo);
            ADD_FAILURE() << typo << " opened";
        } catch (const error & e) {
            EXPECT_EQ(std::string(e.what()).find("SECRET"), std::string::npos) << e.what();
        }
        EXPECT_FALSE(fs::exists(typo)) << typo;
    }
    test::temp_dir d("store");
    auto st = store_open(d.path().string());
    EXPECT_THROW(st->put("../../etc/passwd", {1}), error);
    EXPECT_THROW(st->get("not hex!"), error);
    EXPECT_FALSE(st->get("0123456789abcdef").has_value());
    EXPECT_FALSE(st->erase("0123456789abcdef"));
}

TEST(chunk_store, blend_from_store_hits_equals_blend_from_fresh_collects) {
    auto m = model::load(k_stories);
    engine eng(m, engine_default_params());
    const rag_prompt p = rag_prompt_build(
        m->tokens(), "Stories:", {"Tom had a red ball.", "Sue found a cat.", "Ben swam."}, "Once upon a time", false);
    test::temp_dir d("store");
    auto st = store_open(d.path().string());

    auto run = [&](store * s, chunk_fetch_stats & fs) {
        std::vector<chunk_kv> kv;
        for (const auto & c : p.chunks) kv.push_back(chunk_get_or_collect(s, eng, {}, c, fs));
        std::vector<const chunk_kv *> ptrs;
        for (const auto & c : kv) ptrs.push_back(&c);
        return blend(eng, ptrs, p.query, blend_default_params()).logits;
    };
    chunk_fetch_stats fresh, first, second;
    const std::vector<float> a = run(nullptr, fresh);
    const std::vector<float> b = run(st.get(), first);
    const std::vector<float> c = run(st.get(), second);
    EXPECT_EQ(first.misses, 4);
    EXPECT_EQ(second.hits, 4);
    EXPECT_EQ(second.misses, 0);
    EXPECT_EQ(a, b);
    EXPECT_EQ(a, c);  // bit-exact
}

TEST(chunk_store, two_processes_ingesting_at_once_lose_nothing) {
    test::temp_dir docs("docs"), d("store");
    std::vector<std::string> files;
    for (int i = 0; i < 12; ++i) {
        files.push_back(docs.file("d" + std::to_string(i) + ".txt"));
        std::ofstream(files.back()) << "Story number " << i << ". A child named Kim " << (i % 2 ? "ran" : "sang")
                                    << " in the park with a dog " << i * 7 << " times.\n\nThe end " << i << ".";
    }
    std::string args;
    for (const auto & f : files) args += " " + f;
    const std::string cmd = "ingest -m " + k_stories + " --store " + d.path().string() + " --split paragraph" + args;
    test::run_result r1, r2;
    std::thread t1([&] { r1 = test::run_cli(cmd); });
    std::thread t2([&] { r2 = test::run_cli(cmd); });
    t1.join();
    t2.join();
    ASSERT_EQ(r1.status, 0) << r1.err;
    ASSERT_EQ(r2.status, 0) << r2.err;

    // 24 distinct paragraphs, each stored once, every entry whole and valid
    auto m = model::load(k_stories);
    auto st = store_open(d.path().string());
    EXPECT_EQ(st->list().size(), 24u);
    EXPECT_EQ(st->stats().n_entries, 24u);  // the index agrees with the entries
    for (const auto & e : st->list()) EXPECT_EQ(chunk_entry_check(*st->get(e.key), m.get()), "") << e.key;
    EXPECT_TRUE(fs::is_empty(d.path() / "tmp"));  // no leftovers of the writes

    // a third ingest finds everything stored
    const test::run_result r3 = test::run_cli(cmd);
    ASSERT_EQ(r3.status, 0) << r3.err;
    EXPECT_NE(r3.out.find("0 collected"), std::string::npos) << r3.out;
    EXPECT_NE(r3.out.find("24 already stored"), std::string::npos) << r3.out;
}

TEST(chunk_store, cli_blend_uses_the_store_and_store_commands_work) {
    test::temp_dir docs("docs"), d("store");
    const std::string f1 = docs.file("a.txt"), f2 = docs.file("b.txt");
    std::ofstream(f1) << "Tom had a red ball. He liked to throw it high in the sky.";
    std::ofstream(f2) << "Sue found a little cat in the garden. The cat was hungry.";
    const test::run_result ing =
        test::run_cli("ingest -m " + k_stories + " --store dir:" + d.path().string() + " " + f1 + " " + f2);
    ASSERT_EQ(ing.status, 0) << ing.err;
    const std::string blend_cmd = "blend -m " + k_stories + " --store " + d.path().string() +
                                  " --system 'Stories:' --doc " + f1 + " --doc " + f2 +
                                  " --query 'Once upon a time' -n 4 --json";
    const test::run_result b = test::run_cli(blend_cmd);
    ASSERT_EQ(b.status, 0) << b.err;
    const auto j = nlohmann::json::parse(b.out);
    EXPECT_EQ(j["store_hits"].get<int>(), 2);    // both documents were ingested
    EXPECT_EQ(j["store_misses"].get<int>(), 1);  // the prefix chunk was not
    EXPECT_TRUE(j.contains("load_ms"));
    EXPECT_EQ(nlohmann::json::parse(test::run_cli(blend_cmd).out)["store_misses"].get<int>(), 0);

    const test::run_result stats = test::run_cli("store stats --json --store " + d.path().string());
    ASSERT_EQ(stats.status, 0) << stats.err;
    EXPECT_EQ(nlohmann::json::parse(stats.out)["entries"].get<int>(), 3);
    EXPECT_EQ(test::run_cli("store ls --store " + d.path().string()).status, 0);

    // corrupt one entry on disk: verify finds and removes it
    auto st = store_open(d.path().string());
    const std::string key = st->list()[0].key;
    {
        std::fstream f(entry_file(d, key), std::ios::in | std::ios::out | std::ios::binary);
        f.seekp(200);
        f.put('\x5a');
    }
    const test::run_result v = test::run_cli("store verify -m " + k_stories + " --json --store " + d.path().string());
    ASSERT_EQ(v.status, 0) << v.err;
    EXPECT_EQ(nlohmann::json::parse(v.out)["removed"].get<int>(), 1);
    EXPECT_NE(v.err.find(key), std::string::npos);
    EXPECT_EQ(st->list().size(), 2u);
    const test::run_result gc = test::run_cli("store gc --store-max-gb 0.0000001 --json --store " + d.path().string());
    ASSERT_EQ(gc.status, 0) << gc.err;
    EXPECT_EQ(st->list().size(), 0u);  // a budget of ~100 bytes holds no entry

    EXPECT_EQ(test::run_cli("store frob --store " + d.path().string()).status, 1);
    EXPECT_EQ(test::run_cli("ingest -m " + k_stories + " --store " + d.path().string() + " /nonexistent").status, 1);
}

// a LongRoPE model's chunks of a long context are its long factors' model's
// (their own fingerprint): verify -m checks them against it too, so an entry
// under another chunk's key is found there as under the short factors
TEST(chunk_store, verify_checks_a_longrope_models_long_context_chunks) {
    const std::string phi = test::make_test_model("tiny-phi3-longrope");  // original context 256
    test::temp_dir docs("docs"), d("store");
    const std::string f1 = docs.file("a.txt"), f2 = docs.file("b.txt");
    std::ofstream(f1) << "Tom had a red ball. He liked to throw it high in the sky.";
    std::ofstream(f2) << "Sue found a little cat in the garden. The cat was hungry.";
    const test::run_result ing =
        test::run_cli("ingest -m " + phi + " -c 512 --store dir:" + d.path().string() + " " + f1 + " " + f2);
    ASSERT_EQ(ing.status, 0) << ing.err;
    auto st = store_open(d.path().string());
    const auto entries = st->list();
    ASSERT_EQ(entries.size(), 2u);
    const std::string verify = "store verify -m " + phi + " --json --store " + d.path().string();
    test::run_result v = test::run_cli(verify);
    ASSERT_EQ(v.status, 0) << v.err;
    EXPECT_EQ(nlohmann::json::parse(v.out)["ok"].get<int>(), 2);
    // one chunk's whole entry under the other's key: sound bytes, wrong chunk
    fs::copy_file(entry_file(d, entries[0].key), entry_file(d, entries[1].key), fs::copy_options::overwrite_existing);
    v = test::run_cli(verify);
    ASSERT_EQ(v.status, 0) << v.err;
    EXPECT_EQ(nlohmann::json::parse(v.out)["removed"].get<int>(), 1) << v.err;
    EXPECT_NE(v.err.find(entries[1].key), std::string::npos) << v.err;
}

}  // namespace
}  // namespace kvblend
