// the embedded store: one file per entry plus an index, in a directory.
//
//   DIR/entries/ab/<key>.kvb   entries (ab = the key's first two hex digits)
//   DIR/index                  "key bytes" lines: what the budget counts
//   DIR/lock                   flock(2): serialises index updates and eviction
//   DIR/tmp/                   entries and the index being written: KEY.PID.N,
//                              index.PID.N (N random); gc removes only these
//   DIR/logs/<name>.log        logs (store::log_append): a header, then records
//
// writes go to tmp/, are fsynced and renamed into place, so a reader sees a
// whole entry or none; the index counts an entry before its rename (a crash
// leaves an over-count, which eviction repairs, never an uncounted entry).
// several processes may put the same key at once (the bytes are the same).
// recency for LRU eviction is the entry file's mtime, refreshed on every hit
// (get; peek leaves it). reads take no lock and need no write access; a path
// of an entry that is not a regular file (a directory, a fifo) is a miss for
// reads and is listed, so verify and gc remove it.
#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <random>
#include <sstream>

#include "store/backends.h"

#define XXH_INLINE_ALL
#include <xxhash.h>

namespace kvblend {

namespace fs = std::filesystem;

namespace {

// the largest file read as an entry (a 32k-token chunk of a 70B model in f16 is
// about 10.7 GB); a larger one is not an entry of ours
constexpr uint64_t k_max_entry_bytes = 16ull << 30;
// the first line of every index: what makes a folder a store without entries/
constexpr char k_index_header[] = "kvblend-store-index v1\n";
// the largest index read (a line is about 50 bytes: millions of entries)
constexpr uint64_t k_max_index_bytes = 1ull << 30;

std::string sys_error(const std::string & what, const fs::path & p) {
    return what + " '" + p.string() + "': " + std::strerror(errno);
}

bool valid_key(const std::string & key) {
    if (key.size() < 8 || key.size() > 128) return false;
    return std::all_of(key.begin(), key.end(), [](char c) { return std::isxdigit((unsigned char) c); });
}

// a name put or write_index gives a file in tmp/: KEY.PID.N or index.PID.N
// (and index.PID, the name older versions wrote the index under)
bool is_temp_name(const std::string & name) {
    auto number = [](const std::string & s) {
        return !s.empty() && s.size() <= 20 &&
               std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; });
    };
    const size_t a = name.find('.');
    if (a == std::string::npos) return false;
    const std::string stem = name.substr(0, a), rest = name.substr(a + 1);
    if (stem != "index" && !valid_key(stem)) return false;
    const size_t b = rest.find('.');
    if (b == std::string::npos) return stem == "index" && number(rest);
    return number(rest.substr(0, b)) && number(rest.substr(b + 1));
}

class fd_guard {
  public:
    explicit fd_guard(int fd) : fd_(fd) {}
    ~fd_guard() { reset(-1); }
    fd_guard(const fd_guard &) = delete;
    fd_guard & operator=(const fd_guard &) = delete;
    int get() const { return fd_; }
    void reset(int fd) {
        if (fd_ >= 0) close(fd_);
        fd_ = fd;
    }

  private:
    int fd_;
};

// exclusive flock on DIR/lock for the life of the object
class dir_lock {
  public:
    // a link in the lock's place is not followed (no file is made outside the
    // store), a fifo not waited on
    explicit dir_lock(const fs::path & file)
        : fd_(open(file.c_str(), O_RDWR | O_CREAT | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC, 0644)) {
        if (fd_.get() < 0) throw error(sys_error("cannot open the store lock", file));
        while (flock(fd_.get(), LOCK_EX) != 0)
            if (errno != EINTR) throw error(sys_error("cannot lock", file));
    }

  private:
    fd_guard fd_;  // closing the descriptor releases the lock
};

void write_all(int fd, const uint8_t * p, size_t n, const fs::path & path) {
    while (n > 0) {
        const ssize_t w = write(fd, p, n);
        if (w < 0) {
            if (errno == EINTR) continue;
            throw error(sys_error("cannot write", path));
        }
        p += w;
        n -= (size_t) w;
    }
}

// a temp file is always a new one: O_EXCL fails on anything already there
// (a link is not followed, a fifo not opened)
constexpr int k_temp_flags = O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC;

void fsync_dir(const fs::path & dir) {
    fd_guard d(open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
    if (d.get() >= 0) fsync(d.get());
}

class dir_store : public store {
  public:
    dir_store(const std::string & path, const store_options & opts) : root_(path), opts_(opts) {
        std::error_code ec;
        const bool fresh = check_is_store();
        // an existing store is used as it is (it may be read-only): puts make
        // what they need. entries/ first: another process opening the folder
        // meanwhile sees it empty or a store, never tmp/ alone
        if (fresh && opts_.create) {
            for (const fs::path & p : {root_ / "entries", root_ / "tmp"}) {
                fs::create_directories(p, ec);
                if (ec) throw error("cannot create the store directory '" + p.string() + "': " + ec.message());
            }
        }
        opened_ = fs::is_directory(root_, ec);
    }

    std::string uri() const override { return "dir:" + root_.string(); }

    // a log file: a header ("KVBLOG1\n", a generation, the records written
    // under it, where the good records end and where the last begins), then
    // records, each its length, its XXH32 and its bytes. appends hold the
    // store's lock and go where the good records end: a record an append cut
    // short (a crash) is written over, one damaged since is dropped with what
    // follows it by a rewrite. past twice max_records the file is rewritten
    // with its newest max_records; a rewrite is a new generation (readers
    // whose cursor, "GENERATION:OFFSET", names an older one start over at its
    // first record). a read ends at a record cut short or damaged
    void log_append(const std::string & name, const std::string & record, uint64_t max_records) override {
        log_check(name, record);
        check_not_gone();
        if (!opts_.create && !fs::is_directory(root_ / "logs"))
            throw error("store '" + root_.string() + "' has no logs");
        make_dir(root_ / "logs");
        dir_lock lock(root_ / "lock");
        const fs::path path = log_path(name);
        fd_guard fd(open(path.c_str(), O_RDWR | O_CREAT | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC, 0644));
        if (fd.get() < 0) throw error(sys_error("cannot open", path));
        struct stat st {};
        if (fstat(fd.get(), &st) != 0 || !S_ISREG(st.st_mode)) throw error(sys_error("cannot read", path));
        log_header h;
        if (!read_log_header(fd.get(), h)) {  // new, or not ours: begun again
            h = log_header{};
            h.generation = std::random_device{}() | 1;
            if (ftruncate(fd.get(), 0) != 0 || !pwrite_all(fd.get(), &h, sizeof(h), 0))
                throw error(sys_error("cannot write", path));
        } else if (!log_tail_intact(fd.get(), h, (uint64_t) st.st_size)) {
            // damaged since written: the records before the damage, rewritten
            rewrite_log(path, read_log_records(fd.get(), h), h.generation + 1, std::numeric_limits<uint64_t>::max());
            fd.reset(open(path.c_str(), O_RDWR | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC));
            if (fd.get() < 0 || !read_log_header(fd.get(), h)) throw error(sys_error("cannot reopen", path));
        }
        std::string frame(8, '\0');
        const uint32_t len = (uint32_t) record.size(), sum = XXH32(record.data(), record.size(), 0);
        std::memcpy(frame.data(), &len, 4);
        std::memcpy(frame.data() + 4, &sum, 4);
        frame += record;
        if (!pwrite_all(fd.get(), frame.data(), frame.size(), h.end)) throw error(sys_error("cannot write", path));
        h.last = h.end;
        h.end += frame.size();
        h.count += 1;
        if (!pwrite_all(fd.get(), &h, sizeof(h), 0)) throw error(sys_error("cannot write", path));
        if (h.count > 2 * std::max<uint64_t>(1, max_records))
            rewrite_log(path, read_log_records(fd.get(), h), h.generation + 1, max_records);
    }

    std::vector<std::string> log_read(const std::string & name, std::string & cursor, size_t max) override {
        log_check(name, "");
        std::vector<std::string> out;
        const fs::path path = log_path(name);
        fd_guard fd(open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC));
        if (fd.get() < 0) {
            if (errno == ENOENT) return out;  // nothing written yet
            throw error(sys_error("cannot open", path));
        }
        log_header h;
        if (!read_log_header(fd.get(), h)) return out;
        uint64_t at = sizeof(log_header);
        unsigned long long gen = 0, off = 0;
        if (std::sscanf(cursor.c_str(), "%llu:%llu", &gen, &off) == 2 && gen == h.generation && off >= at)
            at = std::min<uint64_t>(off, h.end);
        for (std::string rec; out.size() < max && at < h.end && read_log_record(fd.get(), at, rec);)
            out.push_back(std::move(rec));
        cursor = std::to_string(h.generation) + ":" + std::to_string(at);
        return out;
    }

    void put(const std::string & key, const std::vector<uint8_t> & bytes) override {
        check_key(key);
        // the budget would evict the entry at once: that is no write
        if (opts_.max_bytes && bytes.size() > opts_.max_bytes)
            throw error("an entry of " + std::to_string(bytes.size()) + " bytes is larger than the store budget of " +
                        std::to_string(opts_.max_bytes) + " bytes");
        const fs::path dst = entry_path(key);
        std::error_code ec;
        check_not_gone();
        check_is_store();  // it may have gone since it was opened, and something else come in its place
        if (!opts_.create && !fs::is_directory(root_, ec)) throw error("store '" + root_.string() + "' does not exist");
        make_dir(root_ / "tmp");
        const fs::path tmp = root_ / "tmp" / temp_name(key);
        {
            fd_guard fd(open(tmp.c_str(), k_temp_flags, 0644));
            if (fd.get() < 0) throw error(sys_error("cannot create", tmp));
            try {
                write_all(fd.get(), bytes.data(), bytes.size(), tmp);
                if (fsync(fd.get()) != 0) throw error(sys_error("cannot fsync", tmp));
            } catch (...) {
                unlink(tmp.c_str());
                throw;
            }
        }
        // counted before it is in place: a crash from here on can leave the
        // index counting an entry that is missing (enforce_budget drops it by
        // stat), never an entry on disk that no budget counts
        try {
            dir_lock lock(root_ / "lock");
            make_dir(dst.parent_path());  // under the lock: an eviction removes the folders it empties
            std::map<std::string, uint64_t> idx = read_index();
            idx[key] = bytes.size();
            write_index(idx);  // fails: nothing is stored
            place(tmp, dst);
            // after the rename: the budget stats the entries, this one too
            const std::map<std::string, uint64_t> counted = idx;
            enforce_budget(idx, key);
            if (idx != counted) {
                try {
                    write_index(idx);
                } catch (const error &) {
                    // the entry is stored: the index still counting what was
                    // evicted is an over-count the next budget check repairs
                }
            }
        } catch (...) {
            unlink(tmp.c_str());  // not in place (or already renamed: then no such file)
            throw;
        }
    }

    std::optional<std::vector<uint8_t>> get(const std::string & key) override { return read_entry(key, true); }
    std::optional<std::vector<uint8_t>> peek(const std::string & key) override { return read_entry(key, false); }

    // n bytes of new memory to read an entry into. a chunk's entry is tens of
    // MB: in 4 KiB pages its first touch is one fault per page, which cost
    // more than the read itself (1.3 GB/s); in 2 MiB pages (asked for where
    // the kernel has transparent huge pages on "madvise") it reads at 3.3 GB/s
    static std::vector<uint8_t> fresh_buffer(size_t n) {
        std::vector<uint8_t> out;
        out.reserve(n);
        constexpr uintptr_t huge = 2u << 20;
        const uintptr_t a = ((uintptr_t) out.data() + huge - 1) & ~(huge - 1),
                        e = ((uintptr_t) out.data() + n) & ~(huge - 1);
        if (n >= 2 * huge && e > a) madvise((void *) a, e - a, MADV_HUGEPAGE);  // a hint: failure changes nothing
        out.resize(n);
        return out;
    }

    // use: a hit is a use, its recency for LRU is now
    std::optional<std::vector<uint8_t>> read_entry(const std::string & key, bool use) {
        check_key(key);
        const fs::path p = entry_path(key);
        // O_NONBLOCK: a fifo in the entry's place must not block the open
        fd_guard fd(open(p.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC));
        if (fd.get() < 0) {
            const int err = errno;
            // the store's own folders unusable (a file in their place, not
            // searchable) is an outage, not a miss: it throws
            if (err == ENOTDIR || err == EACCES || err == ELOOP) check_readable();
            if (err == ENOENT) check_not_gone();
            // missing, or something in its place that is not an entry we may read
            if (err == ENOENT || err == ENOTDIR || err == EISDIR || err == EACCES || err == ELOOP || err == ENXIO)
                return std::nullopt;
            errno = err;
            throw error(sys_error("cannot open", p));
        }
        struct stat st {};
        if (fstat(fd.get(), &st) != 0) throw error(sys_error("cannot stat", p));
        if (!S_ISREG(st.st_mode)) return std::nullopt;
        // no entry is larger than the whole budget, or than k_max_entry_bytes:
        // such a file (a sparse one, say) is not read into memory, it is no entry
        const uint64_t cap =
            opts_.max_bytes ? std::min<uint64_t>(opts_.max_bytes, k_max_entry_bytes) : k_max_entry_bytes;
        if ((uint64_t) st.st_size > cap) return std::nullopt;
        std::vector<uint8_t> out = fresh_buffer((size_t) st.st_size);
        size_t done = 0;
        while (done < out.size()) {
            const ssize_t r = read(fd.get(), out.data() + done, out.size() - done);
            if (r < 0 && errno == EINTR) continue;
            if (r < 0) throw error(sys_error("cannot read", p));
            if (r == 0) break;  // shrank under us: the caller's checks see a truncated entry
            done += (size_t) r;
        }
        out.resize(done);
        if (use) futimens(fd.get(), nullptr);
        return out;
    }

    bool contains(const std::string & key) override {
        check_key(key);
        std::error_code ec;
        // a store that was never made is an empty one (a put creates it); one
        // whose folder went, or something else in its place, cannot work and says so
        for (const fs::path & dir : {root_, root_ / "entries"}) {
            const fs::file_status st = fs::status(dir, ec);
            if (!fs::exists(st) && dir == root_) check_not_gone();  // a stat more only when the folder is missing
            if (fs::exists(st) && !fs::is_directory(st)) throw error("store '" + dir.string() + "' is not a directory");
        }
        return fs::is_regular_file(entry_path(key), ec);
    }

    bool erase(const std::string & key) override {
        check_key(key);
        if (check_is_store()) return false;  // no store yet: nothing to erase, nothing to make
        dir_lock lock(root_ / "lock");
        bool removed = unlink(entry_path(key).c_str()) == 0;
        if (!removed && (errno == EISDIR || errno == EPERM)) {  // a directory in the entry's place
            std::error_code ec;
            removed = fs::remove_all(entry_path(key), ec) > 0 && !ec;
            if (ec) throw error("cannot remove '" + entry_path(key).string() + "': " + ec.message());
        }
        if (removed) remove_if_empty(entry_path(key).parent_path());
        std::map<std::string, uint64_t> idx = read_index();
        if (idx.erase(key) || removed) write_index(idx);
        return removed;
    }

    std::vector<store_entry_info> list() override {
        std::vector<store_entry_info> out;
        for (const auto & e : scan(true)) out.push_back(e.info);
        return out;
    }

    struct scanned {
        store_entry_info info;
        bool regular = true;  // false: something else in an entry's place
    };

    // the entry files themselves: the truth the index summarises. with
    // unreadable: also the entry paths that hold no regular file
    std::vector<scanned> scan(bool unreadable) const {
        std::vector<scanned> out;
        std::error_code ec;
        const fs::path entries = root_ / "entries";
        for (auto sub = fs::directory_iterator(entries, ec); !ec && sub != fs::directory_iterator();
             sub.increment(ec)) {
            std::error_code ec2;
            if (!sub->is_directory(ec2)) continue;
            for (auto it = fs::directory_iterator(sub->path(), ec2); !ec2 && it != fs::directory_iterator();
                 it.increment(ec2)) {
                const fs::path & p = it->path();
                if (p.extension() != ".kvb" || !valid_key(p.stem().string())) continue;
                struct stat st {};
                if (lstat(p.c_str(), &st) != 0) continue;  // removed meanwhile
                const bool regular = S_ISREG(st.st_mode);
                if (!regular && !unreadable) continue;
                out.push_back(
                    {{p.stem().string(), regular ? (uint64_t) st.st_size : 0, (int64_t) st.st_mtime}, regular});
            }
        }
        std::sort(out.begin(), out.end(), [](const auto & a, const auto & b) { return a.info.key < b.info.key; });
        return out;
    }

    store_stats stats() override {
        // no lock: the index is replaced by a rename, a reader sees a whole one
        const std::map<std::string, uint64_t> idx = read_index();
        store_stats s;
        s.n_entries = idx.size();
        for (const auto & [k, n] : idx) s.bytes += n;
        s.max_bytes = opts_.max_bytes;
        s.backend = uri();
        return s;
    }

    uint64_t gc() override {
        std::error_code ec;
        if (!fs::is_directory(root_, ec)) return 0;  // nothing to clean, nothing to create
        check_is_store();
        dir_lock lock(root_ / "lock");
        uint64_t removed = 0;
        removed += remove_dead_temp_files();
        // rebuild the index from the entries themselves (repairs any drift)
        std::map<std::string, uint64_t> idx;
        for (const auto & e : scan(true)) {
            if (e.regular) {
                idx[e.info.key] = e.info.bytes;
            } else if (fs::remove_all(entry_path(e.info.key), ec) > 0) {
                ++removed;  // not an entry: in the way of a future put
                remove_if_empty(entry_path(e.info.key).parent_path());
            }
        }
        removed += enforce_budget(idx, "");
        write_index(idx);
        return removed;
    }

  private:
    fs::path entry_path(const std::string & key) const { return root_ / "entries" / key.substr(0, 2) / (key + ".kvb"); }
    fs::path log_path(const std::string & name) const { return root_ / "logs" / (name + ".log"); }

    struct log_header {
        char magic[8] = {'K', 'V', 'B', 'L', 'O', 'G', '1', '\n'};
        uint64_t generation = 0;
        uint64_t count = 0;                 // records written under this generation
        uint64_t end = sizeof(log_header);  // where the good records end: the next one goes here
        uint64_t last = 0;                  // where the last one begins (0: none)
    };

    static bool read_log_header(int fd, log_header & h) {
        log_header want;
        return pread(fd, &h, sizeof(h), 0) == (ssize_t) sizeof(h) &&
               std::memcmp(h.magic, want.magic, sizeof(want.magic)) == 0 && h.end >= sizeof(h);
    }

    // the header's last record is whole and ends where the header says
    static bool log_tail_intact(int fd, const log_header & h, uint64_t size) {
        if (h.end > size) return false;
        if (h.last == 0) return h.end == sizeof(log_header);
        uint64_t at = h.last;
        std::string rec;
        return read_log_record(fd, at, rec) && at == h.end;
    }

    // the records from the first on, up to the header's end or a damaged one
    static std::vector<std::string> read_log_records(int fd, const log_header & h) {
        std::vector<std::string> all;
        uint64_t at = sizeof(log_header);
        for (std::string rec; at < h.end && read_log_record(fd, at, rec);) all.push_back(std::move(rec));
        return all;
    }

    static bool pwrite_all(int fd, const void * p, size_t n, uint64_t at) {
        const char * c = static_cast<const char *>(p);
        while (n > 0) {
            const ssize_t w = pwrite(fd, c, n, (off_t) at);
            if (w < 0 && errno == EINTR) continue;
            if (w <= 0) return false;
            c += w, n -= (size_t) w, at += (uint64_t) w;
        }
        return true;
    }

    // the record at `at` (moved past it); false at the end, or at a record cut short or damaged
    static bool read_log_record(int fd, uint64_t & at, std::string & rec) {
        uint32_t head[2];
        if (pread(fd, head, sizeof(head), (off_t) at) != (ssize_t) sizeof(head) || head[0] > k_max_log_record)
            return false;
        rec.resize(head[0]);
        if (head[0] > 0 && pread(fd, rec.data(), head[0], (off_t) (at + sizeof(head))) != (ssize_t) head[0])
            return false;
        if (XXH32(rec.data(), rec.size(), 0) != head[1]) return false;
        at += sizeof(head) + head[0];
        return true;
    }

    // under the lock: the newest max_records of all, a new file of generation gen
    void rewrite_log(const fs::path & path, const std::vector<std::string> & all, uint64_t gen, uint64_t max_records) {
        const size_t from = all.size() > max_records ? all.size() - (size_t) max_records : 0;
        log_header n;
        n.generation = gen;
        std::string body;
        for (size_t i = from; i < all.size(); ++i) {
            const uint32_t head[2] = {(uint32_t) all[i].size(), (uint32_t) XXH32(all[i].data(), all[i].size(), 0)};
            n.last = sizeof(n) + body.size();
            body.append(reinterpret_cast<const char *>(head), sizeof(head));
            body += all[i];
            n.count += 1;
        }
        n.end = sizeof(n) + body.size();
        const std::string bytes = std::string(reinterpret_cast<const char *>(&n), sizeof(n)) + body;
        make_dir(root_ / "tmp");
        const fs::path tmp = root_ / "tmp" / temp_name(path.filename().string());
        fd_guard out(open(tmp.c_str(), k_temp_flags, 0644));
        if (out.get() < 0) throw error(sys_error("cannot create", tmp));
        try {
            write_all(out.get(), reinterpret_cast<const uint8_t *>(bytes.data()), bytes.size(), tmp);
        } catch (...) {
            unlink(tmp.c_str());
            throw;
        }
        if (rename(tmp.c_str(), path.c_str()) != 0) {
            unlink(tmp.c_str());
            throw error(sys_error("cannot replace", path));
        }
    }

    static void make_dir(const fs::path & p) {
        std::error_code ec;
        fs::create_directories(p, ec);
        if (ec) throw error("cannot create '" + p.string() + "': " + ec.message());
    }
    // under the lock: an entries/XX folder left empty goes (a put makes it again under the lock)
    static void remove_if_empty(const fs::path & shard) { rmdir(shard.c_str()); }

    // a store opened on a folder that is gone since (removed, unmounted) is an
    // outage until the folder is back, not an empty store: its ids would be
    // "unknown" while they are only out of reach, and a put would make a new
    // store where the old one should be mounted
    void check_not_gone() const {
        std::error_code ec;
        if (opened_ && !fs::exists(fs::symlink_status(root_, ec)))
            throw error(
                "the store's folder '" + root_.string() + "' is gone (removed or unmounted since it was opened)",
                error_kind::store_unavailable);
    }

    // a read that failed below the store's own folders: throws when the store
    // itself cannot be read (its folder or entries/ not a directory, or not
    // searchable); a missing store is an empty one
    void check_readable() const {
        for (const fs::path & dir : {root_, root_ / "entries"}) {
            struct stat st {};
            if (stat(dir.c_str(), &st) != 0) {
                if (errno == ENOENT) return;
                throw error(sys_error("cannot read the store at", dir));
            }
            if (!S_ISDIR(st.st_mode)) throw error("store '" + dir.string() + "' is not a directory");
            if (access(dir.c_str(), X_OK) != 0) throw error(sys_error("cannot read the store at", dir));
        }
    }

    // a file in tmp/: STEM.PID.N, N random (gc knows these names, and only these)
    std::string temp_name(const std::string & stem) {
        return stem + "." + std::to_string(getpid()) + "." + std::to_string(random_());
    }

    // a folder of someone else's files is no store: no put may write an index
    // into it, no gc clean its tmp/, and what reads find there is not ours.
    // a store has entries/ or an index of ours; true: a store to make, a
    // missing folder or one holding nothing but what a store makes before its
    // entries/ (the lock and tmp/ of an erase or gc there, or of a process
    // making the store this moment)
    bool check_is_store() const {
        std::error_code ec;
        const fs::file_status st = fs::status(root_, ec);
        if (!fs::exists(st)) return true;
        if (!fs::is_directory(st)) throw error("store path '" + root_.string() + "' is not a directory");
        if (fs::is_directory(root_ / "entries", ec) || index_is_ours()) return false;
        std::string stranger;
        for (fs::directory_iterator it(root_, ec), end; !ec && it != end; it.increment(ec)) {
            const std::string name = it->path().filename().string();
            const fs::file_type type = it->symlink_status(ec).type();
            if (ec) break;
            if ((name == "lock" && type == fs::file_type::regular) ||
                (name == "tmp" && type == fs::file_type::directory))
                continue;
            // entries/ or an index that came in while the folder was listed:
            // a store another process is making
            if ((name == "entries" || name == "index") && (fs::is_directory(root_ / "entries") || index_is_ours()))
                return false;
            stranger = name;
            break;
        }
        if (!ec && stranger.empty()) return true;
        const std::string why = ec ? "it cannot be listed (" + ec.message() + ")"
                                   : "it holds other files ('" + stranger + "'), but no entries/ and no kvblend index";
        throw error("'" + root_.string() + "' is not a kvblend store: " + why + " (use an empty or a new directory)");
    }

    // DIR/index is a regular file that begins with our header line
    bool index_is_ours() const {
        fd_guard fd(open((root_ / "index").c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC));
        struct stat st {};
        if (fd.get() < 0 || fstat(fd.get(), &st) != 0 || !S_ISREG(st.st_mode)) return false;
        char head[sizeof(k_index_header) - 1];
        size_t done = 0;
        while (done < sizeof(head)) {
            const ssize_t r = read(fd.get(), head + done, sizeof(head) - done);
            if (r < 0 && errno == EINTR) continue;
            if (r <= 0) break;
            done += (size_t) r;
        }
        return done == sizeof(head) && std::memcmp(head, k_index_header, sizeof(head)) == 0;
    }

    // leftovers of writers that died: files of our temp names older than ten
    // minutes, nothing else. tmp/ is opened without following a link (it would
    // clean someone else's folder) and each name is judged by lstat, so a link
    // named like ours goes, not what it points to
    uint64_t remove_dead_temp_files() const {
        const int dfd = open((root_ / "tmp").c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
        if (dfd < 0) return 0;
        DIR * dir = fdopendir(dfd);
        if (!dir) {
            close(dfd);
            return 0;
        }
        const time_t cutoff = time(nullptr) - 10 * 60;
        uint64_t removed = 0;
        while (const dirent * e = readdir(dir)) {
            struct stat st {};
            if (!is_temp_name(e->d_name) || fstatat(dfd, e->d_name, &st, AT_SYMLINK_NOFOLLOW) != 0) continue;
            if (!S_ISDIR(st.st_mode) && st.st_mtime < cutoff && unlinkat(dfd, e->d_name, 0) == 0) ++removed;
        }
        closedir(dir);  // closes dfd
        return removed;
    }

    // rename a written temp file into the entry's place
    static void place(const fs::path & tmp, const fs::path & dst) {
        bool placed = rename(tmp.c_str(), dst.c_str()) == 0;
        if (!placed && (errno == EISDIR || errno == ENOTEMPTY || errno == EEXIST)) {
            // a directory where the entry goes: not ours to keep, replace it
            std::error_code ec;
            fs::remove_all(dst, ec);
            placed = rename(tmp.c_str(), dst.c_str()) == 0;
        }
        if (!placed) throw error(sys_error("cannot rename into", dst));
        fsync_dir(dst.parent_path());
    }

    static void check_key(const std::string & key) {
        if (!valid_key(key)) throw error("invalid store key '" + key + "'");
    }

    std::map<std::string, uint64_t> read_index() const {
        std::map<std::string, uint64_t> idx;
        // the index is a summary: anything but a regular file of a sane size
        // in its place (a fifo, /dev/zero, a 30 GB file) is not read, the
        // entries are listed instead
        std::string text;
        {
            struct stat st {};
            fd_guard fd(open((root_ / "index").c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC));
            if (fd.get() >= 0 && fstat(fd.get(), &st) == 0 && S_ISREG(st.st_mode) &&
                (uint64_t) st.st_size <= k_max_index_bytes) {
                text.resize((size_t) st.st_size);
                size_t done = 0;
                while (done < text.size()) {
                    const ssize_t r = read(fd.get(), &text[done], text.size() - done);
                    if (r < 0 && errno == EINTR) continue;
                    if (r <= 0) break;  // a read error or a file that shrank: what was read is checked below
                    done += (size_t) r;
                }
                text.resize(done);
            }
        }
        std::istringstream f(text);
        std::string line;
        if (!f || !std::getline(f, line) || line + '\n' != k_index_header) {
            // missing or unreadable: the entries are the truth, rebuild from them
            for (const auto & e : scan(false)) idx[e.info.key] = e.info.bytes;
            return idx;
        }
        std::string key;
        uint64_t n;
        while (f >> key >> n)
            if (valid_key(key)) idx[key] = n;
        return idx;
    }

    void write_index(const std::map<std::string, uint64_t> & idx) {
        mkdir((root_ / "tmp").c_str(), 0755);  // a gc of an empty folder has none yet; a failure shows below
        // a name nobody can guess, made new: whatever someone planted in tmp/
        // (a link out of the store, a fifo) is never followed or waited on
        const fs::path tmp = root_ / "tmp" / temp_name("index");
        std::string text = k_index_header;
        for (const auto & [k, n] : idx) text += k + ' ' + std::to_string(n) + '\n';
        {
            // every byte written and synced before it replaces the index: a full
            // disk is an error here, never a shorter index renamed into place
            fd_guard fd(open(tmp.c_str(), k_temp_flags, 0644));
            if (fd.get() < 0) throw error(sys_error("cannot write the store index", tmp));
            try {
                write_all(fd.get(), (const uint8_t *) text.data(), text.size(), tmp);
                if (fsync(fd.get()) != 0) throw error(sys_error("cannot fsync", tmp));
            } catch (...) {
                unlink(tmp.c_str());
                throw;
            }
        }
        if (rename(tmp.c_str(), (root_ / "index").c_str()) != 0) {
            const std::string msg = sys_error("cannot replace", root_ / "index");
            unlink(tmp.c_str());
            throw error(msg);
        }
    }

    // under the lock: evict least recently used entries until the budget
    // holds; `keep` (the entry just written) goes last
    uint64_t enforce_budget(std::map<std::string, uint64_t> & idx, const std::string & keep) {
        if (opts_.max_bytes == 0) return 0;
        uint64_t total = 0;
        for (const auto & [k, n] : idx) total += n;
        if (total <= opts_.max_bytes) return 0;
        struct aged {
            int64_t mtime_ns;
            std::string key;
        };
        // the index is a summary anyone can edit: before anything is evicted,
        // each entry's size is what its file holds (a wrong size in the index
        // must never cost the valid entries)
        std::vector<aged> order;
        total = 0;
        for (auto it = idx.begin(); it != idx.end();) {
            struct stat st {};
            if (stat(entry_path(it->first).c_str(), &st) != 0 || !S_ISREG(st.st_mode)) {
                it = idx.erase(it);  // gone, or not an entry: it holds no bytes of the budget
                continue;
            }
            it->second = (uint64_t) st.st_size;
            total += it->second;
            const int64_t t = (int64_t) st.st_mtim.tv_sec * 1000000000 + st.st_mtim.tv_nsec;
            order.push_back({it->first == keep ? INT64_MAX : t, it->first});
            ++it;
        }
        std::sort(order.begin(), order.end(), [](const aged & a, const aged & b) { return a.mtime_ns < b.mtime_ns; });
        uint64_t removed = 0;
        for (const aged & a : order) {
            if (total <= opts_.max_bytes) break;
            unlink(entry_path(a.key).c_str());
            remove_if_empty(entry_path(a.key).parent_path());
            total -= idx[a.key];
            idx.erase(a.key);
            ++removed;
        }
        return removed;
    }

    fs::path root_;
    store_options opts_;
    bool opened_ = false;  // its folder was there when it was opened
    std::mt19937_64 random_{std::random_device{}()};
};

}  // namespace

std::unique_ptr<store> dir_store_open(const std::string & path, const store_options & opts) {
    if (path.empty()) throw error("empty store directory", error_kind::invalid_argument);
    return std::make_unique<dir_store>(path, opts);
}

}  // namespace kvblend
