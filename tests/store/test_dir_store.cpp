// the dir store against what others leave in and around it: links and fifos
// planted where it writes, a tmp/ that is a link, a directory that is no store,
// a failed index write in the middle of a put; and reads that must not count
// as a use (verify).
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <thread>

#include "cli_run.h"
#include "kvblend/store.h"
#include "store/log_contract.h"
#include "test_util.h"

namespace kvblend {
namespace {

namespace fs = std::filesystem;

const std::string k_stories = std::string(KVBLEND_TEST_MODELS) + "/stories260K.gguf";

fs::path entry_file(const fs::path & root, const std::string & key) {
    return test::dir_entry_file(root, key);
}

std::string slurp(const fs::path & p) {
    std::ifstream f(p, std::ios::binary);
    return std::string((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
}

// the path itself (a link, not its target) last modified at unix second t
void set_mtime(const fs::path & p, time_t t) {
    const timespec ts[2] = {{t, 0}, {t, 0}};
    ASSERT_EQ(utimensat(AT_FDCWD, p.c_str(), ts, AT_SYMLINK_NOFOLLOW), 0) << p;
}

time_t mtime_of(const fs::path & p) {
    struct stat st {};
    EXPECT_EQ(stat(p.c_str(), &st), 0) << p;
    return st.st_mtime;
}

const time_t k_an_hour_ago = time(nullptr) - 3600;

// the old index writer opened the predictable tmp/index.<pid> with O_TRUNC and
// followed what it found there: a link made a put overwrite a file outside the
// store (and the index became that link), a fifo made gc wait forever while it
// held the store's lock
TEST(dir_store, the_index_is_written_through_no_planted_link_or_fifo) {
    test::temp_dir d("store"), outside("victim");
    auto st = store_open(d.path().string());
    st->put("aaaa0000aaaa0000", std::vector<uint8_t>(100, 1));
    const fs::path victim = outside.path() / "precious";
    std::ofstream(victim) << "precious";
    const fs::path planted = d.path() / "tmp" / ("index." + std::to_string(getpid()));
    fs::create_symlink(victim, planted);
    st->put("bbbb0000bbbb0000", std::vector<uint8_t>(100, 2));
    EXPECT_EQ(slurp(victim), "precious");
    EXPECT_TRUE(fs::is_regular_file(fs::symlink_status(d.path() / "index")));
    EXPECT_EQ(st->stats().n_entries, 2u);

    // a fifo where the index would be written: gc runs in a child (the name
    // has the writer's pid in it), which must finish, not wait for a reader
    const pid_t pid = fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
        const fs::path fifo = d.path() / "tmp" / ("index." + std::to_string(getpid()));
        if (mkfifo(fifo.c_str(), 0600) != 0) _exit(3);
        int rc = 0;
        try {
            store_open(d.path().string())->gc();
        } catch (const std::exception &) {
            rc = 1;
        }
        unlink(fifo.c_str());
        _exit(rc);
    }
    int status = 0;
    pid_t done = 0;
    for (int i = 0; i < 300 && done == 0; ++i) {
        done = waitpid(pid, &status, WNOHANG);
        if (done == 0) std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    if (done == 0) {
        kill(pid, SIGKILL);
        waitpid(pid, &status, 0);
        FAIL() << "gc waited on a fifo in tmp/ for 30 s";
    }
    ASSERT_TRUE(WIFEXITED(status));
    EXPECT_EQ(WEXITSTATUS(status), 0);
    EXPECT_EQ(st->stats().n_entries, 2u);
}

// gc cleans up after writers that died: only the names it writes itself, by
// the name's own age, and never through a tmp/ that is a link
TEST(dir_store, gc_removes_only_its_own_leftovers_and_never_through_a_linked_tmp) {
    test::temp_dir d("store"), other("user");
    auto st = store_open(d.path().string());
    st->put("aaaa0000aaaa0000", std::vector<uint8_t>(100, 1));
    const fs::path tmp = d.path() / "tmp";
    auto old_file = [&](const fs::path & p) {
        std::ofstream(p) << "x";
        set_mtime(p, k_an_hour_ago);
    };
    old_file(tmp / "notes.txt");                         // not ours
    old_file(tmp / "0123456789abcdef.123.456");          // an entry being written by a writer that died
    old_file(tmp / "index.123.789");                     // an index being written
    old_file(tmp / "index.123");                         // an index of the old writer
    std::ofstream(tmp / "0123456789abcdef.1.2") << "x";  // being written now
    // a link named like ours: the link goes, not what it points to
    old_file(other.path() / "keep");
    fs::create_symlink(other.path() / "keep", tmp / "fedcba9876543210.5.6");
    set_mtime(tmp / "fedcba9876543210.5.6", k_an_hour_ago);
    st->gc();
    EXPECT_TRUE(fs::exists(tmp / "notes.txt"));
    EXPECT_FALSE(fs::exists(tmp / "0123456789abcdef.123.456"));
    EXPECT_FALSE(fs::exists(tmp / "index.123.789"));
    EXPECT_FALSE(fs::exists(tmp / "index.123"));
    EXPECT_TRUE(fs::exists(tmp / "0123456789abcdef.1.2"));
    EXPECT_FALSE(fs::exists(fs::symlink_status(tmp / "fedcba9876543210.5.6")));
    EXPECT_TRUE(fs::exists(other.path() / "keep"));

    // tmp/ itself a link to someone's folder: gc does not clean there
    fs::remove_all(tmp);
    fs::create_symlink(other.path(), tmp);
    old_file(other.path() / "0123456789abcdef.9.9");
    st->gc();
    EXPECT_TRUE(fs::exists(other.path() / "0123456789abcdef.9.9"));
    EXPECT_TRUE(fs::exists(other.path() / "keep"));
    EXPECT_TRUE(st->contains("aaaa0000aaaa0000"));
}

// a directory of other files is no store: no command writes an index into it
// or cleans its tmp/, reads are refused too. An empty or missing one is fine
TEST(dir_store, a_directory_that_is_no_store_is_refused) {
    test::temp_dir d("proj"), docs("docs");
    const std::string users_index = "chapter 1: page 3\n";
    std::ofstream(d.path() / "index") << users_index;
    fs::create_directories(d.path() / "tmp");
    std::ofstream(d.path() / "tmp" / "draft.txt") << "draft";
    set_mtime(d.path() / "tmp" / "draft.txt", k_an_hour_ago);
    for (const bool create : {true, false}) {
        store_options so;
        so.create = create;
        const std::string e = test::error_of([&] { store_open(d.path().string(), so); });
        EXPECT_NE(e.find("'" + d.path().string() + "' is not a kvblend store"), std::string::npos) << e;
    }
    const std::string doc = docs.file("a.txt");
    std::ofstream(doc) << "Tom had a red ball.";
    for (const std::string & cmd :
         std::vector<std::string>{"store gc", "store stats", "store verify", "ingest -m " + k_stories + " " + doc}) {
        const test::run_result r = test::run_cli(cmd + " --store " + d.path().string());
        EXPECT_EQ(r.status, 1) << cmd << ": " << r.out;
        EXPECT_NE(r.err.find("is not a kvblend store"), std::string::npos) << cmd << ": " << r.err;
    }
    EXPECT_EQ(slurp(d.path() / "index"), users_index);
    EXPECT_TRUE(fs::exists(d.path() / "tmp" / "draft.txt"));
    EXPECT_FALSE(fs::exists(d.path() / "entries"));

    // an empty folder becomes a store, a missing one is made on put, and a
    // store with nothing but its index (a gc of an empty folder) is one
    test::temp_dir e("store");
    store_open(e.path().string())->put("aaaa0000aaaa0000", std::vector<uint8_t>(100, 1));
    EXPECT_EQ(store_open(e.path().string())->stats().n_entries, 1u);
    store_open(e.file("new"))->put("aaaa0000aaaa0000", std::vector<uint8_t>(100, 1));
    EXPECT_EQ(store_open(e.file("new"))->stats().n_entries, 1u);
    fs::create_directories(e.path() / "gc");
    store_options ro;
    ro.create = false;
    store_open(e.file("gc"), ro)->gc();
    EXPECT_EQ(store_open(e.file("gc"), ro)->stats().n_entries, 0u);

    // what a store makes before its entries/ (its lock, tmp/) is no stranger:
    // a second process that lists the folder while the first one makes the
    // store, or after an erase there, sees a store to make
    fs::create_directories(e.path() / "early" / "tmp");
    std::ofstream(e.path() / "early" / "lock");
    EXPECT_FALSE(store_open(e.file("early"), ro)->erase("aaaa0000aaaa0000"));
    store_open(e.file("early"))->put("aaaa0000aaaa0000", std::vector<uint8_t>(100, 1));
    EXPECT_EQ(store_open(e.file("early"), ro)->stats().n_entries, 1u);
    fs::create_directories(e.path() / "erased");
    EXPECT_FALSE(store_open(e.file("erased"), ro)->erase("aaaa0000aaaa0000"));
    EXPECT_TRUE(fs::is_empty(e.path() / "erased"));  // nothing made in a folder that is no store yet

    // a stranger's name is in the error
    fs::create_directories(e.path() / "notes" / "tmp");
    std::ofstream(e.path() / "notes" / "todo.txt") << "buy milk";
    const std::string err = test::error_of([&] { store_open(e.file("notes")); });
    EXPECT_NE(err.find("'todo.txt'"), std::string::npos) << err;
}

TEST(dir_store, logs_keep_their_newest_records_in_order) {
    test::temp_dir d("store");
    auto st = store_open(d.path().string());
    test::check_log_contract(*st);
    // a reader of another process sees what this one appends; a damaged
    // record ends a read at the records before it; a log file of someone
    // else's is begun again by the next append
    auto other = store_open(d.path().string());
    std::string cur;
    for (int i = 0; i < 3; ++i) st->log_append("d", "rec" + std::to_string(i), 100);
    EXPECT_EQ(other->log_read("d", cur, 10).size(), 3u);
    const std::string log = d.file("logs/d.log");
    {
        std::fstream f(log, std::ios::in | std::ios::out | std::ios::binary);
        f.seekp(-2, std::ios::end);
        f.put('#');
    }
    std::string fresh;
    EXPECT_EQ(other->log_read("d", fresh, 10), (std::vector<std::string>{"rec0", "rec1"}));
    // the next append drops the damaged record and is read after the others
    st->log_append("d", "after", 100);
    fresh.clear();
    EXPECT_EQ(other->log_read("d", fresh, 10), (std::vector<std::string>{"rec0", "rec1", "after"}));
    // a record cut short (a crash mid-append) is written over by the next one
    fs::resize_file(log, fs::file_size(log) - 1);
    st->log_append("d", "again", 100);
    fresh.clear();
    EXPECT_EQ(other->log_read("d", fresh, 10), (std::vector<std::string>{"rec0", "rec1", "again"}));
    std::ofstream(log, std::ios::trunc) << "not a log";
    std::string none;
    EXPECT_TRUE(other->log_read("d", none, 10).empty());
    st->log_append("d", "again", 100);
    EXPECT_EQ(other->log_read("d", none, 10), (std::vector<std::string>{"again"}));
    // logs are no entries: listing, verify and gc leave them
    EXPECT_TRUE(st->list().empty());
    st->gc();
    fresh.clear();
    EXPECT_EQ(other->log_read("d", fresh, 10).size(), 1u);
}

// verify reads every entry: that is no use of it, or the next put under a
// budget would evict the entries that are really hot
TEST(dir_store, verify_and_peek_leave_recency_alone) {
    test::temp_dir d("store"), docs("docs");
    const std::string f1 = docs.file("a.txt"), f2 = docs.file("b.txt");
    std::ofstream(f1) << "Tom had a red ball.";
    std::ofstream(f2) << "Sue found a cat.";
    ASSERT_EQ(test::run_cli("ingest -m " + k_stories + " --store " + d.path().string() + " " + f1 + " " + f2).status,
              0);
    auto st = store_open(d.path().string());
    const std::vector<store_entry_info> listed = st->list();
    ASSERT_EQ(listed.size(), 2u);
    const fs::path a = entry_file(d.path(), listed[0].key), b = entry_file(d.path(), listed[1].key);
    set_mtime(a, 100);
    set_mtime(b, 200);
    const test::run_result v = test::run_cli("store verify --json -m " + k_stories + " --store " + d.path().string());
    ASSERT_EQ(v.status, 0) << v.err;
    EXPECT_EQ(nlohmann::json::parse(v.out)["ok"].get<int>(), 2) << v.out;
    EXPECT_EQ(mtime_of(a), 100);
    EXPECT_EQ(mtime_of(b), 200);

    const auto peeked = st->peek(listed[0].key);
    ASSERT_TRUE(peeked.has_value());
    EXPECT_EQ(mtime_of(a), 100);
    EXPECT_EQ(st->get(listed[0].key), peeked);  // a get is a use
    EXPECT_GT(mtime_of(a), 200);
    EXPECT_FALSE(st->peek("0123456789abcdef").has_value());
}

// a put records its entry in the index before the entry is in place: an index
// that cannot be written fails the put with nothing stored (before, the entry
// stayed, counted by no budget, and the put still reported a failure)
TEST(dir_store, a_put_whose_index_cannot_be_written_stores_nothing) {
    test::temp_dir d("store");
    auto st = store_open(d.path().string());
    st->put("aaaa0000aaaa0000", std::vector<uint8_t>(100, 1));
    fs::remove(d.path() / "index");
    fs::create_directories(d.path() / "index" / "sub");  // no file can be renamed onto it
    const std::string e = test::error_of([&] { st->put("bbbb0000bbbb0000", std::vector<uint8_t>(100, 2)); });
    EXPECT_NE(e.find("index"), std::string::npos) << e;
    EXPECT_FALSE(fs::exists(fs::symlink_status(entry_file(d.path(), "bbbb0000bbbb0000"))));
    EXPECT_FALSE(st->contains("bbbb0000bbbb0000"));
    for (const auto & f : fs::directory_iterator(d.path() / "tmp")) ADD_FAILURE() << "left behind: " << f.path();
    fs::remove_all(d.path() / "index");
    st->put("bbbb0000bbbb0000", std::vector<uint8_t>(100, 2));
    EXPECT_EQ(st->stats().n_entries, 2u);
}

// what a crash between a put's index write and its rename leaves: an index line
// for an entry that is not there. It holds no bytes of the budget, so the
// budget still holds and evicts no more than it must
TEST(dir_store, the_budget_holds_when_the_index_lists_a_missing_entry) {
    test::temp_dir d("store");
    store_options so;
    so.max_bytes = 2500;
    auto st = store_open(d.path().string(), so);
    const std::vector<uint8_t> blob(1000, 7);
    st->put("aaaa0000aaaa0000", blob);
    st->put("bbbb0000bbbb0000", blob);
    set_mtime(entry_file(d.path(), "aaaa0000aaaa0000"), 100);
    set_mtime(entry_file(d.path(), "bbbb0000bbbb0000"), 200);
    std::ofstream(d.path() / "index", std::ios::trunc)
        << "kvblend-store-index v1\naaaa0000aaaa0000 1000\nbbbb0000bbbb0000 1000\ncccc0000cccc0000 1000\n";
    st->put("dddd0000dddd0000", blob);  // 3000 bytes on disk: the oldest goes, only it
    EXPECT_FALSE(st->contains("aaaa0000aaaa0000"));
    EXPECT_TRUE(st->contains("bbbb0000bbbb0000"));
    EXPECT_TRUE(st->contains("dddd0000dddd0000"));
    const store_stats s = st->stats();
    EXPECT_EQ(s.n_entries, 2u);
    EXPECT_EQ(s.bytes, 2000u);
    uint64_t on_disk = 0;
    for (const auto & e : st->list()) on_disk += e.bytes;
    EXPECT_LE(on_disk, so.max_bytes);
}

}  // namespace
}  // namespace kvblend
