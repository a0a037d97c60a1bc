// kvblend tests: run the CLI binary and capture its exit status and output.
#pragma once

#include <sys/wait.h>

#include <cstdlib>
#include <fstream>
#include <iterator>
#include <string>

#include "test_util.h"

namespace kvblend::test {

struct run_result {
    int status = -1;  // exit status; 128 + signal when killed
    std::string out;  // stdout
    std::string err;  // stderr
};

// `prefix` runs before the binary on the command line (a wrapper such as setpriv)
inline run_result run_cli(const std::string & args, const std::string & prefix = "") {
    temp_dir dir("cli");
    const std::string cmd =
        prefix + std::string(KVBLEND_CLI) + " " + args + " > " + dir.file("out") + " 2> " + dir.file("err");
    const int rc = std::system(cmd.c_str());
    run_result r;
    r.status = WIFEXITED(rc) ? WEXITSTATUS(rc) : 128 + WTERMSIG(rc);
    auto slurp = [](const std::string & p) {
        std::ifstream f(p, std::ios::binary);
        return std::string((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    };
    r.out = slurp(dir.file("out"));
    r.err = slurp(dir.file("err"));
    return r;
}

}  // namespace kvblend::test
