// a ggml-rpc-server child process on a free loopback port, for the rpc tests:
// started by the test, stopped by its destructor, and killed by the kernel
// when the test process dies first (PR_SET_PDEATHSIG), so no test leaves one
// behind, even one that crashes.
#pragma once

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <stdexcept>
#include <string>
#include <thread>

namespace kvblend::test {

class rpc_server {
  public:
    // tries a few free ports (another process may take one between the probe
    // and the server's bind); throws std::runtime_error when none comes up
    rpc_server() {
        for (int attempt = 0; attempt < 5 && pid_ <= 0; ++attempt) {
            port_ = free_port();
            if (port_ > 0) spawn();
        }
        if (pid_ <= 0) throw std::runtime_error("cannot start " + std::string(KVBLEND_RPC_SERVER));
    }
    ~rpc_server() { stop(); }
    rpc_server(const rpc_server &) = delete;
    rpc_server & operator=(const rpc_server &) = delete;

    int port() const { return port_; }
    std::string endpoint() const { return "127.0.0.1:" + std::to_string(port_); }
    std::string device() const { return "rpc:" + endpoint(); }  // model_params::device

    // the server process is still running (not exited, not killed by a signal)
    bool alive() const { return pid_ > 0 && waitpid(pid_, nullptr, WNOHANG) == 0; }

    void stop() {
        if (pid_ <= 0) return;
        kill(pid_, SIGTERM);
        if (!reap(2000)) {
            kill(pid_, SIGKILL);
            reap(5000);
        }
        pid_ = -1;
    }

  private:
    static int free_port() {
        const int fd = socket(AF_INET, SOCK_STREAM, 0);
        if (fd < 0) return -1;
        sockaddr_in a{};
        a.sin_family = AF_INET;
        a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        a.sin_port = 0;
        socklen_t len = sizeof(a);
        int port = -1;
        if (bind(fd, (sockaddr *) &a, sizeof(a)) == 0 && getsockname(fd, (sockaddr *) &a, &len) == 0)
            port = ntohs(a.sin_port);
        close(fd);
        return port;
    }

    static bool accepts(int port) {
        const int fd = socket(AF_INET, SOCK_STREAM, 0);
        if (fd < 0) return false;
        sockaddr_in a{};
        a.sin_family = AF_INET;
        a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        a.sin_port = htons((uint16_t) port);
        const bool ok = connect(fd, (sockaddr *) &a, sizeof(a)) == 0;
        close(fd);
        return ok;
    }

    // true when the child has exited (and is reaped) within ms
    bool reap(int ms) {
        for (int waited = 0; waited <= ms; waited += 10) {
            int st = 0;
            if (waitpid(pid_, &st, WNOHANG) == pid_) return true;
            std::this_thread::sleep_for(std::chrono::milliseconds(10));
        }
        return false;
    }

    void spawn() {
        const pid_t parent = getpid();
        const std::string port = std::to_string(port_);
        const pid_t pid = fork();
        if (pid < 0) return;
        if (pid == 0) {
            prctl(PR_SET_PDEATHSIG, SIGKILL);
            if (getppid() != parent) _exit(127);  // the parent died before prctl
            const int null = open("/dev/null", O_WRONLY);
            if (null >= 0) dup2(null, 1), dup2(null, 2);
            execl(KVBLEND_RPC_SERVER, KVBLEND_RPC_SERVER, "-H", "127.0.0.1", "-p", port.c_str(), "-t", "1",
                  (char *) nullptr);
            _exit(127);
        }
        pid_ = pid;
        // bounded wait for the listening socket: 10 s
        for (int waited = 0; waited < 10000; waited += 20) {
            if (accepts(port_)) return;
            int st = 0;
            if (waitpid(pid_, &st, WNOHANG) == pid_) {  // it exited: the port was taken
                pid_ = -1;
                return;
            }
            std::this_thread::sleep_for(std::chrono::milliseconds(20));
        }
        stop();
    }

    pid_t pid_ = -1;
    int port_ = -1;
};

}  // namespace kvblend::test
