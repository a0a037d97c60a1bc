// the store under faults: a failed put is an error to whoever asked to store,
// anything unreadable in an entry's place is a miss and is found by verify/gc
// (dir and redis), a read-only store still serves, read-only commands change
// nothing, budgets and entry positions are checked.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "cli_run.h"
#include "kvblend/blend.h"
#include "kvblend/codec.h"
#include "kvblend/rag.h"
#include "kvblend/rag_prompt.h"
#include "kvblend/store.h"
#include "store/backends.h"
#include "store/redis_server.h"
#include "test_util.h"

#define XXH_INLINE_ALL
#include <xxhash.h>

namespace kvblend {
namespace {

namespace fs = std::filesystem;

const std::string k_stories = std::string(KVBLEND_TEST_MODELS) + "/stories260K.gguf";

fs::path entry_file(const fs::path & root, const std::string & key) {
    return test::dir_entry_file(root, key);
}

// the CLI as a user without write access to root-owned files: root ignores
// permissions, so as root the command drops to nobody (setpriv, util-linux)
test::run_result run_cli_unprivileged(const std::string & args) {
    return test::run_cli(args, getuid() == 0 ? "setpriv --reuid=65534 --regid=65534 --clear-groups " : "");
}

// takes write permission away from everything under p (the unprivileged run
// lacks it anyway: the files are someone else's)
void make_read_only(const fs::path & p) {
    for (auto it = fs::recursive_directory_iterator(p); it != fs::recursive_directory_iterator(); ++it)
        fs::permissions(it->path(), fs::perms::owner_write | fs::perms::group_write | fs::perms::others_write,
                        fs::perm_options::remove);
    fs::permissions(p, fs::perms::owner_write | fs::perms::group_write | fs::perms::others_write,
                    fs::perm_options::remove);
}
void make_writable(const fs::path & p) {
    fs::permissions(p, fs::perms::owner_write, fs::perm_options::add);
    for (auto it = fs::recursive_directory_iterator(p); it != fs::recursive_directory_iterator(); ++it)
        fs::permissions(it->path(), fs::perms::owner_write, fs::perm_options::add);
}

// a world-readable temp folder (the unprivileged runs read the documents)
struct docs_dir {
    test::temp_dir d{"docs"};
    docs_dir() { fs::permissions(d.path(), fs::perms::all, fs::perm_options::add); }
    std::string write(const std::string & name, const std::string & text) const {
        std::ofstream(d.file(name)) << text;
        return d.file(name);
    }
};

std::string ingest_cmd(const fs::path & store, const std::string & files) {
    return "ingest -m " + k_stories + " --store dir:" + store.string() + " " + files;
}

TEST(store_faults, ingest_into_a_read_only_store_fails_with_the_reason) {
    docs_dir docs;
    const std::string f = docs.write("a.txt", "Tom had a red ball. He liked to throw it high in the sky.");
    test::temp_dir d("store");
    ASSERT_EQ(test::run_cli(ingest_cmd(d.path(), docs.write("b.txt", "Sue found a cat."))).status, 0);
    make_read_only(d.path());
    const test::run_result r = run_cli_unprivileged(ingest_cmd(d.path(), f));
    make_writable(d.path());
    EXPECT_EQ(r.status, 1) << r.out << r.err;
    EXPECT_NE(r.err.find("error: could not store chunk"), std::string::npos) << r.err;
    EXPECT_EQ(r.out.find("1 collected"), std::string::npos) << r.out;
    EXPECT_EQ(store_open(d.path().string())->list().size(), 1u);  // nothing was added
}

TEST(store_faults, ingest_whose_put_fails_exits_1) {
    docs_dir docs;
    const std::string f = docs.write("a.txt", "Tom had a red ball.");
    // the store's tmp/ is a file: no entry can be written, whoever runs it
    test::temp_dir d("store");
    store_open(d.path().string());
    fs::remove_all(d.path() / "tmp");
    std::ofstream(d.path() / "tmp") << "in the way";
    const test::run_result r = test::run_cli(ingest_cmd(d.path(), f));
    EXPECT_EQ(r.status, 1) << r.out;
    EXPECT_NE(r.err.find("could not store chunk"), std::string::npos) << r.err;
    EXPECT_TRUE(store_open(d.path().string())->list().empty());
}

TEST(store_faults, a_put_larger_than_the_budget_is_an_error) {
    test::temp_dir d("store");
    store_options so;
    so.max_bytes = 100;
    auto st = store_open(d.path().string(), so);
    EXPECT_THROW(st->put("0123456789abcdef", std::vector<uint8_t>(101, 1)), error);
    EXPECT_FALSE(st->contains("0123456789abcdef"));
    st->put("0123456789abcdef", std::vector<uint8_t>(100, 1));
    EXPECT_TRUE(st->contains("0123456789abcdef"));

    // --store-max-gb 1e-10 is a 1-byte budget, not "unlimited": nothing fits
    docs_dir docs;
    const std::string f = docs.write("a.txt", "Tom had a red ball.");
    test::temp_dir d2("store");
    const test::run_result r = test::run_cli(ingest_cmd(d2.path(), f) + " --store-max-gb 1e-10");
    EXPECT_EQ(r.status, 1) << r.out;
    EXPECT_NE(r.err.find("larger than the store budget of 1 bytes"), std::string::npos) << r.err;
    // and gc honours it too
    ASSERT_EQ(test::run_cli(ingest_cmd(d2.path(), f)).status, 0);
    const test::run_result gc = test::run_cli("store gc --json --store-max-gb 1e-10 --store " + d2.path().string());
    ASSERT_EQ(gc.status, 0) << gc.err;
    EXPECT_EQ(nlohmann::json::parse(gc.out)["entries"].get<int>(), 0);
}

TEST(store_faults, dir_entry_replaced_by_a_directory_is_a_miss_and_verify_and_gc_remove_it) {
    auto m = model::load(k_stories);
    engine eng(m, engine_default_params());
    test::temp_dir d("store");
    auto st = store_open(d.path().string());
    const std::vector<llama_token> a = rag_doc_tokens(m->tokens(), "Tom had a red ball.");
    const std::vector<llama_token> b = rag_doc_tokens(m->tokens(), "Sue found a cat.");
    chunk_fetch_stats fs0;
    chunk_get_or_collect(st.get(), eng, {}, a, fs0);
    chunk_get_or_collect(st.get(), eng, {}, b, fs0);
    const std::string ka = chunk_key(*m, eng.cache().type_k(), "raw", {}, a);
    const std::string kb = chunk_key(*m, eng.cache().type_k(), "raw", {}, b);

    auto replace_by_dir = [&](const std::string & key) {
        fs::remove(entry_file(d.path(), key));
        fs::create_directories(entry_file(d.path(), key) / "sub");
        std::ofstream(entry_file(d.path(), key) / "sub" / "x") << "x";
    };
    replace_by_dir(ka);
    EXPECT_FALSE(st->get(ka).has_value());
    EXPECT_FALSE(st->contains(ka));
    // a blend treats it as a miss, collects again and replaces the directory
    chunk_fetch_stats fs1;
    chunk_get_or_collect(st.get(), eng, {}, a, fs1);
    chunk_get_or_collect(st.get(), eng, {}, b, fs1);
    EXPECT_EQ(fs1.misses, 1);
    EXPECT_EQ(fs1.hits, 1);
    EXPECT_TRUE(st->get(ka).has_value());

    // verify lists and removes it
    replace_by_dir(ka);
    EXPECT_EQ(st->list().size(), 2u);
    const test::run_result v = test::run_cli("store verify --json --store " + d.path().string());
    ASSERT_EQ(v.status, 0) << v.err;
    EXPECT_EQ(nlohmann::json::parse(v.out)["removed"].get<int>(), 1) << v.out;
    EXPECT_EQ(nlohmann::json::parse(v.out)["ok"].get<int>(), 1) << v.out;
    EXPECT_NE(v.err.find(ka), std::string::npos) << v.err;
    EXPECT_FALSE(fs::exists(entry_file(d.path(), ka)));

    // and so does gc
    replace_by_dir(kb);
    const test::run_result g = test::run_cli("store gc --json --store " + d.path().string());
    ASSERT_EQ(g.status, 0) << g.err;
    EXPECT_EQ(nlohmann::json::parse(g.out)["removed"].get<int>(), 1) << g.out;
    EXPECT_FALSE(fs::exists(entry_file(d.path(), kb)));
}

// the index is a summary: a fifo, /dev/zero or a huge file in its place is not
// read (it hung, or grew without bound); the entries are listed instead
TEST(store_faults, an_index_that_is_no_plain_file_is_not_read) {
    docs_dir docs;
    test::temp_dir d("store");
    ASSERT_EQ(test::run_cli(ingest_cmd(d.path(), docs.write("a.txt", "Tom had a red ball."))).status, 0);
    const fs::path index = d.path() / "index";
    for (int kind = 0; kind < 3; ++kind) {
        fs::remove(index);
        if (kind == 0) {
            ASSERT_EQ(mkfifo(index.c_str(), 0600), 0);
        }
        if (kind == 1) fs::create_symlink("/dev/zero", index);
        if (kind == 2) {
            std::ofstream(index) << "kvblend-store-index v1\n";
            fs::resize_file(index, 2ull << 30);
        }
        const test::run_result r = test::run_cli("store stats --json --store " + d.path().string(), "timeout 60 ");
        ASSERT_EQ(r.status, 0) << kind << ": " << r.err;
        EXPECT_EQ(nlohmann::json::parse(r.out)["entries"].get<int>(), 1) << kind << ": " << r.out;
    }
}

// verify removes what is known to be bad, not what it cannot read: an entry
// another user's mode keeps from it, or (here, as any user can make one) a
// sparse file larger than any entry. It stays, is named, and verify says it
// could not verify everything
TEST(store_faults, verify_leaves_an_entry_it_cannot_read) {
    docs_dir docs;
    test::temp_dir d("store");
    ASSERT_EQ(test::run_cli(ingest_cmd(d.path(), docs.write("a.txt", "Tom had a red ball."))).status, 0);
    ASSERT_EQ(test::run_cli(ingest_cmd(d.path(), docs.write("b.txt", "Sue found a cat."))).status, 0);
    const std::vector<store_entry_info> listed = store_open(d.path().string())->list();
    ASSERT_EQ(listed.size(), 2u);
    const std::string big = listed[0].key;
    fs::resize_file(entry_file(d.path(), big), 20ull << 30);
    const test::run_result v = test::run_cli("store verify --json -m " + k_stories + " --store " + d.path().string());
    EXPECT_EQ(v.status, 1) << v.out << v.err;
    const nlohmann::json j = nlohmann::json::parse(v.out);
    EXPECT_EQ(j["ok"].get<int>(), 1) << v.out;
    EXPECT_EQ(j["removed"].get<int>(), 0) << v.out;
    EXPECT_EQ(j["skipped"].get<int>(), 1) << v.out;
    EXPECT_NE(v.err.find("skipped " + big), std::string::npos) << v.err;
    EXPECT_TRUE(fs::exists(entry_file(d.path(), big)));
}

TEST(store_faults, read_only_store_with_a_corrupt_entry_serves_the_rest) {
    docs_dir docs;
    const std::string f1 = docs.write("a.txt", "Tom had a red ball. He liked to throw it high in the sky.");
    const std::string f2 = docs.write("b.txt", "Sue found a little cat in the garden. The cat was hungry.");
    test::temp_dir d("store");
    ASSERT_EQ(test::run_cli(ingest_cmd(d.path(), f1 + " " + f2)).status, 0);
    auto st = store_open(d.path().string());
    const std::string bad = st->list()[0].key;
    {
        std::fstream f(entry_file(d.path(), bad), std::ios::in | std::ios::out | std::ios::binary);
        f.seekp(200);
        f.put('\x5a');
    }
    make_read_only(d.path());
    const std::string blend = "blend -m " + k_stories + " --store " + d.path().string() + " --doc " + f1 + " --doc " +
                              f2 + " --query 'Once upon a time' -n 2 --json";
    const test::run_result r = run_cli_unprivileged(blend);
    // read-only commands work on it too
    const test::run_result s = run_cli_unprivileged("store stats --json --store " + d.path().string());
    const test::run_result l = run_cli_unprivileged("store ls --store " + d.path().string());
    make_writable(d.path());
    ASSERT_EQ(r.status, 0) << r.err;
    const auto j = nlohmann::json::parse(r.out);
    EXPECT_EQ(j["store_hits"].get<int>(), 1);
    EXPECT_EQ(j["store_misses"].get<int>(), 2);  // the corrupt one and the prefix chunk
    EXPECT_NE(r.err.find(bad), std::string::npos) << r.err;
    ASSERT_EQ(s.status, 0) << s.err;
    EXPECT_EQ(nlohmann::json::parse(s.out)["entries"].get<int>(), 2);
    ASSERT_EQ(l.status, 0) << l.err;
    EXPECT_NE(l.out.find(bad), std::string::npos);
}

TEST(store_faults, read_only_commands_create_nothing) {
    test::temp_dir d("store");
    const fs::path gone = d.path() / "nonexistent" / "x";
    for (const std::string what : {"stats", "ls", "verify", "gc"}) {
        const test::run_result r = test::run_cli("store " + what + " --json --store dir:" + gone.string());
        EXPECT_EQ(r.status, 0) << what << ": " << r.err;
        EXPECT_FALSE(fs::exists(d.path() / "nonexistent")) << what;
    }
    // stats and ls leave an existing store as it was: no lock, no index written
    docs_dir docs;
    ASSERT_EQ(test::run_cli(ingest_cmd(d.path() / "s", docs.write("a.txt", "Tom had a red ball."))).status, 0);
    fs::remove(d.path() / "s" / "lock");
    fs::remove(d.path() / "s" / "index");
    for (const std::string what : {"stats", "ls"}) {
        const test::run_result r = test::run_cli("store " + what + " --store " + (d.path() / "s").string());
        EXPECT_EQ(r.status, 0) << r.err;
        EXPECT_FALSE(fs::exists(d.path() / "s" / "lock")) << what;
        EXPECT_FALSE(fs::exists(d.path() / "s" / "index")) << what;
    }
}

// an entry whose first position is out of range: refused on decode
TEST(store_faults, entry_pos0_is_range_checked) {
    auto m = model::load(k_stories);
    engine eng(m, engine_default_params());
    const chunk_kv c = collect(eng, rag_doc_tokens(m->tokens(), "Tom had a red ball."));
    std::vector<uint8_t> b = chunk_encode(*m, c, {});
    ASSERT_EQ(chunk_entry_check(b, m.get()), "");
    for (int64_t pos0 : {int64_t(1) << 62, int64_t(-1), int64_t(INT32_MAX)}) {
        std::memcpy(&b[88], &pos0, 8);  // docs/STORE_FORMAT.md: pos0 at byte 88
        const XXH128_hash_t sum = XXH3_128bits(b.data(), b.size() - 16);
        const uint64_t words[2] = {sum.low64, sum.high64};
        std::memcpy(&b[b.size() - 16], words, 16);
        EXPECT_NE(chunk_entry_check(b, m.get()).find("position"), std::string::npos) << pos0;
        EXPECT_THROW(chunk_decode(*m, b), error) << pos0;
    }
}

// gemma4's windowed and global layers have other head sizes, and its last
// layers keep no K/V: an entry holds the owning layers, with head_dim 0 and
// a table of each layer's head size (docs/STORE_FORMAT.md); a table that lies
// is refused, whatever it claims
TEST(store_faults, per_layer_head_sizes_are_carried_and_checked) {
    auto m = model::load(test::make_test_model("tiny-gemma4"));
    const model_hparams & hp = m->hparams();
    ASSERT_LT(hp.n_layer_kv, hp.n_layer);
    ASSERT_NE(hp.head_dim_of(0), hp.head_dim_of(hp.n_layer_kv - 1));
    engine eng(m, engine_default_params());
    const chunk_kv c = collect(eng, rag_doc_tokens(m->tokens(), "Tom had a red ball. He liked to throw it."));
    ASSERT_EQ(c.widths, hp.kv_widths());
    std::vector<uint8_t> b = chunk_encode(*m, c, {});
    uint32_t head_dim = 1, header = 0;
    std::memcpy(&head_dim, &b[56], 4);
    std::memcpy(&header, &b[12], 4);
    EXPECT_EQ(head_dim, 0u);
    EXPECT_EQ(header, 104 + 4 * (c.n_tokens() + hp.n_layer_kv));
    ASSERT_EQ(chunk_entry_check(b, m.get()), "");
    const chunk_kv back = chunk_decode(*m, b);
    EXPECT_EQ(back.widths, c.widths);
    ASSERT_EQ(back.bytes(), c.bytes());
    EXPECT_EQ(std::memcmp(back.k(0), c.k(0), c.bytes()), 0);
    for (const char * name : {"q8_0", "kivi4", "cachegen", "turboquant3"}) {
        const auto cd = codec_by_name(name);
        EXPECT_EQ(chunk_decode(*m, chunk_encode(*m, c, {}, cd.get())).widths, c.widths) << name;
    }
    const size_t table = header - 4 * hp.n_layer_kv;
    for (const uint32_t lie : {(uint32_t) hp.head_dim_of(hp.n_layer_kv - 1), 0u, 0x7fffffffu}) {
        std::vector<uint8_t> forged = b;
        std::memcpy(&forged[table], &lie, 4);  // layer 0's head size
        const XXH128_hash_t sum = XXH3_128bits(forged.data(), forged.size() - 16);
        const uint64_t words[2] = {sum.low64, sum.high64};
        std::memcpy(&forged[forged.size() - 16], words, 16);
        EXPECT_NE(chunk_entry_check(forged, m.get()), "") << lie;
        EXPECT_THROW(chunk_decode(*m, forged), error) << lie;
    }
}

class store_faults_redis : public ::testing::Test {
  protected:
    void SetUp() override {
        try {
            server_ = std::make_unique<test::redis_server>();
        } catch (const std::exception & e) {
            FAIL() << e.what();
        }
    }
    std::unique_ptr<test::redis_server> server_;
};

// a key someone else wrote under our prefix may hold any byte: store ls and
// verify print each key on one line, its odd bytes escaped, so that no key
// forges a line of the listing
TEST_F(store_faults_redis, a_key_with_a_newline_forges_no_line) {
    ASSERT_EQ(server_->command({"SET", "kvblend:chunk:fake\n0123456789abcdef0123456789abcdef 999999 0", "x"}), "+OK");
    ASSERT_EQ(server_->command({"SET", "kvblend:chunk:0123456789abcdef0123456789abcdef", "y"}), "+OK");
    const test::run_result ls = test::run_cli("store ls --store " + server_->uri());
    ASSERT_EQ(ls.status, 0) << ls.err;
    EXPECT_EQ(std::count(ls.out.begin(), ls.out.end(), '\n'), 2) << ls.out;
    EXPECT_NE(ls.out.find("fake\\x0a0123"), std::string::npos) << ls.out;
    const test::run_result v = test::run_cli("store verify --store " + server_->uri());
    EXPECT_NE(v.err.find("removed fake\\x0a0123"), std::string::npos) << v.err;
    // nor is JSON output refused for a key that is not UTF-8
    ASSERT_EQ(server_->command({"SET", "kvblend:chunk:bad\xff", "z"}), "+OK");
    const test::run_result js = test::run_cli("store ls --json --store " + server_->uri());
    ASSERT_EQ(js.status, 0) << js.err;
    const nlohmann::json rows = nlohmann::json::parse(js.out);  // verify removed the two above
    ASSERT_EQ(rows.size(), 1u) << js.out;
    EXPECT_EQ(rows[0]["key"], "bad\xef\xbf\xbd");  // the odd byte as U+FFFD
}

// a key of another type under our prefix: a miss, listed, and removed by verify
TEST_F(store_faults_redis, wrong_type_key_is_a_miss_and_verify_removes_it) {
    auto m = model::load(k_stories);
    engine eng(m, engine_default_params());
    auto st = store_open(server_->uri());
    const std::vector<llama_token> a = rag_doc_tokens(m->tokens(), "Tom had a red ball.");
    const std::vector<llama_token> b = rag_doc_tokens(m->tokens(), "Sue found a cat.");
    const std::string ka = chunk_key(*m, eng.cache().type_k(), "raw", {}, a);
    chunk_fetch_stats fs0;
    chunk_get_or_collect(st.get(), eng, {}, a, fs0);
    chunk_get_or_collect(st.get(), eng, {}, b, fs0);

    // an entry replaced by a list (its size record stays), and a stray list
    ASSERT_EQ(server_->command({"DEL", "kvblend:chunk:" + ka}), ":1");
    ASSERT_EQ(server_->command({"LPUSH", "kvblend:chunk:" + ka, "a"}), ":1");
    ASSERT_EQ(server_->command({"LPUSH", "kvblend:chunk:0123456789abcdef", "a"}), ":1");
    EXPECT_FALSE(st->get(ka).has_value());
    EXPECT_FALSE(st->contains(ka));
    EXPECT_EQ(st->list().size(), 3u);

    // a blend gets a miss and writes the entry again
    chunk_fetch_stats fs1;
    chunk_get_or_collect(st.get(), eng, {}, a, fs1);
    EXPECT_EQ(fs1.misses, 1);
    EXPECT_TRUE(st->get(ka).has_value());

    ASSERT_EQ(server_->command({"DEL", "kvblend:chunk:" + ka}), ":1");
    ASSERT_EQ(server_->command({"LPUSH", "kvblend:chunk:" + ka, "a"}), ":1");
    const test::run_result v = test::run_cli("store verify --json --store " + server_->uri());
    ASSERT_EQ(v.status, 0) << v.err;
    EXPECT_EQ(nlohmann::json::parse(v.out)["removed"].get<int>(), 2) << v.out;
    EXPECT_EQ(nlohmann::json::parse(v.out)["ok"].get<int>(), 1) << v.out;
    EXPECT_EQ(server_->command({"EXISTS", "kvblend:chunk:" + ka}), ":0");
    EXPECT_EQ(server_->command({"EXISTS", "kvblend:chunk:0123456789abcdef"}), ":0");
    EXPECT_EQ(st->list().size(), 1u);
}

}  // namespace
}  // namespace kvblend
