// libFuzzer: the dir store's index reader and entry scan. the input is the
// store's index file; stats() reads it, and a put/erase rewrite it under the
// lock. any index must give numbers or a kvblend::error, never a crash.
#include <filesystem>
#include <fstream>

#include "fuzz_common.h"
#include "kvblend/store.h"

using namespace kvblend;

extern "C" int LLVMFuzzerInitialize(int *, char ***) {
    fuzz::maybe_write_seeds([] {
        const std::string a = "kvblend-store-index v1\n0123456789abcdef0123456789abcdef 1234\n";
        const std::string b =
            "kvblend-store-index v1\nabcdef0123456789 18446744073709551615\nzz 1\n0123456789abcdef -5\n";
        const std::string c = "kvblend-store-index v2\n";
        return std::vector<std::vector<uint8_t>>{{a.begin(), a.end()}, {b.begin(), b.end()}, {c.begin(), c.end()}};
    });
    return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t * data, size_t size) {
    if (size > (64u << 10)) return -1;
    namespace fs = std::filesystem;
    const fs::path root = fuzz::work_dir() / "store";
    static bool made = false;
    store_options so;
    so.max_bytes = 4096;  // exercise the budget arithmetic with the index's sizes
    if (!made) {
        store_open(root.string(), so)->put("00000000aaaaaaaa", std::vector<uint8_t>(100, 1));
        made = true;
    }
    std::ofstream(root / "index", std::ios::binary | std::ios::trunc)
        .write((const char *) data, (std::streamsize) size);
    try {
        auto st = store_open(root.string(), so);
        const store_stats s = st->stats();
        (void) s;
        (void) st->list();
        if (size > 0 && data[0] & 1) {
            st->put("00000000bbbbbbbb", std::vector<uint8_t>(10, 2));
            st->erase("00000000bbbbbbbb");
        }
    } catch (const kvblend::error &) {
    }
    return 0;
}
