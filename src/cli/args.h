// kvblend CLI: a small flag parser. every bad flag is a message, not a crash.
#pragma once

#include <cctype>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "kvblend/common.h"

namespace kvblend::cli {

// the whole of s as an integer / a number; nothing when it is not one (or is
// empty, or begins with a space, which std::stoll and std::stod would skip)
inline std::optional<int64_t> to_integer(const std::string & s) {
    if (s.empty() || std::isspace((unsigned char) s[0])) return std::nullopt;
    size_t n = 0;
    long long v = 0;
    try {
        v = std::stoll(s, &n);
    } catch (...) {
        return std::nullopt;
    }
    if (s.empty() || n != s.size()) return std::nullopt;
    return v;
}

inline std::optional<double> to_real(const std::string & s) {
    if (s.empty() || std::isspace((unsigned char) s[0])) return std::nullopt;
    size_t n = 0;
    double v = 0;
    try {
        v = std::stod(s, &n);
    } catch (...) {
        return std::nullopt;
    }
    if (s.empty() || n != s.size()) return std::nullopt;
    return v;
}

// s cut at every sep: "a,,b" -> a, "", b; "" -> one empty part
inline std::vector<std::string> split(const std::string & s, char sep) {
    std::vector<std::string> parts;
    size_t start = 0;
    while (start <= s.size()) {
        size_t end = s.find(sep, start);
        if (end == std::string::npos) end = s.size();
        parts.push_back(s.substr(start, end - start));
        start = end + 1;
    }
    return parts;
}

// walks "--flag value" / "-f value" / "--switch" arguments. a value that is
// missing, malformed or out of range throws kvblend::error naming the flag.
class args {
  public:
    args(int argc, char ** argv, int first) {
        for (int i = first; i < argc; ++i) items_.emplace_back(argv[i]);
    }

    bool done() const { return pos_ >= items_.size(); }
    const std::string & peek() const { return items_[pos_]; }

    // true (and consumes it) when the next item is one of the names
    bool match(std::initializer_list<const char *> names) {
        if (done()) return false;
        for (const char * n : names) {
            if (items_[pos_] == n) {
                flag_ = n;
                ++pos_;
                return true;
            }
        }
        return false;
    }

    std::string str() {
        if (done()) throw error("missing value after " + flag_);
        return items_[pos_++];
    }

    int64_t integer(int64_t lo, int64_t hi) {
        const std::string s = str();
        const std::optional<int64_t> iv = to_integer(s);
        if (!iv) throw error(flag_ + " expects an integer, got '" + s + "'");
        const int64_t v = *iv;
        if (v < lo || v > hi)
            throw error(flag_ + " must be in [" + std::to_string(lo) + ", " + std::to_string(hi) + "], got " + s);
        return v;
    }

    double real(double lo, double hi) {
        const std::string s = str();
        const std::optional<double> rv = to_real(s);
        const double v = rv.value_or(0);
        if (!rv || !(v >= lo && v <= hi))
            throw error(flag_ + " expects a number in [" + fmt(lo) + ", " + fmt(hi) + "], got '" + s + "'");
        return v;
    }

    // comma-separated integers, each in [lo, hi]
    std::vector<int64_t> integers(int64_t lo, int64_t hi) {
        std::vector<int64_t> out;
        for (const std::string & part : list("integers in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]")) {
            const std::optional<int64_t> v = to_integer(part);
            if (!v || *v < lo || *v > hi) bad_list();
            out.push_back(*v);
        }
        return out;
    }

    // comma-separated numbers, each in [lo, hi]
    std::vector<double> reals(double lo, double hi) {
        std::vector<double> out;
        for (const std::string & part : list("numbers in [" + fmt(lo) + ", " + fmt(hi) + "]")) {
            const std::optional<double> v = to_real(part);
            if (!v || !(*v >= lo && *v <= hi)) bad_list();
            out.push_back(*v);
        }
        return out;
    }

    [[noreturn]] void unknown() const { throw error("unknown argument '" + items_[pos_] + "' (see --help)"); }

    // the next value split at commas, each part non-empty (codec names, …)
    std::vector<std::string> names() {
        std::vector<std::string> out = list("names");
        for (const std::string & n : out)
            if (n.empty()) bad_list();
        return out;
    }

  private:
    // the next value split at commas; remembers what a bad list gets told
    std::vector<std::string> list(const std::string & what) {
        list_value_ = str();
        list_what_ = what;
        return split(list_value_, ',');
    }

    [[noreturn]] void bad_list() const {
        throw error(flag_ + " expects comma-separated " + list_what_ + ", got '" + list_value_ + "'");
    }

    static std::string fmt(double v) {
        std::string s = std::to_string(v);
        s.erase(s.find_last_not_of('0') + 1);
        if (!s.empty() && s.back() == '.') s.pop_back();
        return s;
    }

    std::vector<std::string> items_;
    size_t pos_ = 0;
    std::string flag_;
    std::string list_value_, list_what_;
};

}  // namespace kvblend::cli
