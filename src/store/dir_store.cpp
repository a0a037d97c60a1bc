// the embedded store: one file per entry plus an index, in a directory.
//
//   DIR/entries/ab/<key>.kvb   entries (ab = the key's first two hex digits)
//   DIR/index                  "key bytes" lines: what the budget counts
//   DIR/lock                   flock(2): serialises index updates and eviction
//   DIR/tmp/                   entries being written
//
// writes go to tmp/, are fsynced and renamed into place, so a reader sees a
// whole entry or none; several processes may put the same key at once (the
// bytes are the same). recency for LRU eviction is the entry file's mtime,
// refreshed on every hit.
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <sstream>

#include "store/backends.h"

namespace kvblend {

namespace fs = std::filesystem;

namespace {

std::string sys_error(const std::string & what, const fs::path & p) {
    return what + " '" + p.string() + "': " + std::strerror(errno);
}

bool valid_key(const std::string & key) {
    if (key.size() < 8 || key.size() > 128) return false;
    return std::all_of(key.begin(), key.end(), [](char c) { return std::isxdigit((unsigned char) c); });
}

class fd_guard {
  public:
    explicit fd_guard(int fd) : fd_(fd) {}
    ~fd_guard() {
        if (fd_ >= 0) close(fd_);
    }
    int get() const { return fd_; }

  private:
    int fd_;
};

// exclusive flock on DIR/lock for the life of the object
class dir_lock {
  public:
    explicit dir_lock(const fs::path & file) : fd_(open(file.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644)) {
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

void fsync_dir(const fs::path & dir) {
    fd_guard d(open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
    if (d.get() >= 0) fsync(d.get());
}

class dir_store : public store {
  public:
    dir_store(const std::string & path, const store_options & opts) : root_(path), opts_(opts) {
        std::error_code ec;
        for (const fs::path & p : {root_, root_ / "entries", root_ / "tmp"}) {
            fs::create_directories(p, ec);
            if (ec) throw error("cannot create the store directory '" + p.string() + "': " + ec.message());
        }
        if (!fs::is_directory(root_)) throw error("store path '" + path + "' is not a directory");
    }

    std::string uri() const override { return "dir:" + root_.string(); }

    void put(const std::string & key, const std::vector<uint8_t> & bytes) override {
        check_key(key);
        const fs::path dst = entry_path(key);
        std::error_code ec;
        fs::create_directories(dst.parent_path(), ec);
        if (ec) throw error("cannot create '" + dst.parent_path().string() + "': " + ec.message());
        const fs::path tmp = root_ / "tmp" / (key + "." + std::to_string(getpid()) + "." + std::to_string(random_()));
        {
            fd_guard fd(open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644));
            if (fd.get() < 0) throw error(sys_error("cannot create", tmp));
            try {
                write_all(fd.get(), bytes.data(), bytes.size(), tmp);
                if (fsync(fd.get()) != 0) throw error(sys_error("cannot fsync", tmp));
            } catch (...) {
                unlink(tmp.c_str());
                throw;
            }
        }
        if (rename(tmp.c_str(), dst.c_str()) != 0) {
            const std::string msg = sys_error("cannot rename into", dst);
            unlink(tmp.c_str());
            throw error(msg);
        }
        fsync_dir(dst.parent_path());

        dir_lock lock(root_ / "lock");
        std::map<std::string, uint64_t> idx = read_index();
        idx[key] = bytes.size();
        enforce_budget(idx, key);
        write_index(idx);
    }

    std::optional<std::vector<uint8_t>> get(const std::string & key) override {
        check_key(key);
        const fs::path p = entry_path(key);
        fd_guard fd(open(p.c_str(), O_RDONLY | O_CLOEXEC));
        if (fd.get() < 0) {
            if (errno == ENOENT) return std::nullopt;
            throw error(sys_error("cannot open", p));
        }
        struct stat st {};
        if (fstat(fd.get(), &st) != 0) throw error(sys_error("cannot stat", p));
        std::vector<uint8_t> out((size_t) st.st_size);
        size_t done = 0;
        while (done < out.size()) {
            const ssize_t r = read(fd.get(), out.data() + done, out.size() - done);
            if (r < 0 && errno == EINTR) continue;
            if (r < 0) throw error(sys_error("cannot read", p));
            if (r == 0) break;  // shrank under us: the caller's checks see a truncated entry
            done += (size_t) r;
        }
        out.resize(done);
        futimens(fd.get(), nullptr);  // recency for LRU: now
        return out;
    }

    bool contains(const std::string & key) override {
        check_key(key);
        std::error_code ec;
        return fs::exists(entry_path(key), ec);
    }

    bool erase(const std::string & key) override {
        check_key(key);
        dir_lock lock(root_ / "lock");
        const bool removed = unlink(entry_path(key).c_str()) == 0;
        std::map<std::string, uint64_t> idx = read_index();
        if (idx.erase(key) || removed) write_index(idx);
        return removed;
    }

    std::vector<store_entry_info> list() override { return scan(); }

    // the entry files themselves: the truth the index summarises
    std::vector<store_entry_info> scan() const {
        std::vector<store_entry_info> out;
        std::error_code ec;
        for (auto it = fs::recursive_directory_iterator(root_ / "entries", ec); !ec && it != fs::recursive_directory_iterator();
             it.increment(ec)) {
            if (!it->is_regular_file(ec) || it->path().extension() != ".kvb") continue;
            struct stat st {};
            if (stat(it->path().c_str(), &st) != 0) continue;  // removed meanwhile
            out.push_back({it->path().stem().string(), (uint64_t) st.st_size, (int64_t) st.st_mtime});
        }
        std::sort(out.begin(), out.end(), [](const auto & a, const auto & b) { return a.key < b.key; });
        return out;
    }

    store_stats stats() override {
        dir_lock lock(root_ / "lock");
        const std::map<std::string, uint64_t> idx = read_index();
        store_stats s;
        s.n_entries = idx.size();
        for (const auto & [k, n] : idx) s.bytes += n;
        s.max_bytes = opts_.max_bytes;
        s.backend = uri();
        return s;
    }

    uint64_t gc() override {
        dir_lock lock(root_ / "lock");
        uint64_t removed = 0;
        // leftovers of writers that died: tmp files older than ten minutes
        std::error_code ec;
        const auto now = fs::file_time_type::clock::now();
        for (auto it = fs::directory_iterator(root_ / "tmp", ec); !ec && it != fs::directory_iterator(); it.increment(ec)) {
            const auto age = now - it->last_write_time(ec);
            if (!ec && age > std::chrono::minutes(10) && fs::remove(it->path(), ec)) ++removed;
        }
        // rebuild the index from the entries themselves (repairs any drift)
        std::map<std::string, uint64_t> idx;
        for (const auto & e : scan()) idx[e.key] = e.bytes;
        removed += enforce_budget(idx, "");
        write_index(idx);
        return removed;
    }

  private:
    fs::path entry_path(const std::string & key) const { return root_ / "entries" / key.substr(0, 2) / (key + ".kvb"); }

    static void check_key(const std::string & key) {
        if (!valid_key(key)) throw error("invalid store key '" + key + "'");
    }

    std::map<std::string, uint64_t> read_index() const {
        std::map<std::string, uint64_t> idx;
        std::ifstream f(root_ / "index");
        std::string line;
        if (!f || !std::getline(f, line) || line != "kvblend-store-index v1") {
            // missing or unreadable: the entries are the truth, rebuild from them
            for (const auto & e : scan()) idx[e.key] = e.bytes;
            return idx;
        }
        std::string key;
        uint64_t n;
        while (f >> key >> n)
            if (valid_key(key)) idx[key] = n;
        return idx;
    }

    void write_index(const std::map<std::string, uint64_t> & idx) const {
        const fs::path tmp = root_ / "tmp" / ("index." + std::to_string(getpid()));
        {
            std::ofstream f(tmp, std::ios::trunc);
            f << "kvblend-store-index v1\n";
            for (const auto & [k, n] : idx) f << k << ' ' << n << '\n';
            if (!f) throw error("cannot write the store index in '" + root_.string() + "'");
        }
        if (rename(tmp.c_str(), (root_ / "index").c_str()) != 0) throw error(sys_error("cannot replace", root_ / "index"));
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
        std::vector<aged> order;
        for (const auto & [k, n] : idx) {
            struct stat st {};
            int64_t t = 0;
            if (stat(entry_path(k).c_str(), &st) == 0) t = (int64_t) st.st_mtim.tv_sec * 1000000000 + st.st_mtim.tv_nsec;
            order.push_back({k == keep ? INT64_MAX : t, k});
        }
        std::sort(order.begin(), order.end(), [](const aged & a, const aged & b) { return a.mtime_ns < b.mtime_ns; });
        uint64_t removed = 0;
        for (const aged & a : order) {
            if (total <= opts_.max_bytes) break;
            unlink(entry_path(a.key).c_str());
            total -= idx[a.key];
            idx.erase(a.key);
            ++removed;
        }
        return removed;
    }

    fs::path root_;
    store_options opts_;
    std::mt19937_64 random_{std::random_device{}()};
};

}  // namespace

std::unique_ptr<store> dir_store_open(const std::string & path, const store_options & opts) {
    if (path.empty()) throw error("empty store directory");
    return std::make_unique<dir_store>(path, opts);
}

}  // namespace kvblend
