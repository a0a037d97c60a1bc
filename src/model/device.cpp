// which ggml device a model runs on: model_params::device, named as llama.cpp
// names devices (--device, --rpc, -ngl), resolved to a registered device.
#include "model/device.h"

#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <cstring>
#include <map>
#include <mutex>
#include <thread>

#include "ggml-backend.h"
#include "ggml-rpc.h"

namespace kvblend {

namespace {

std::string lower(std::string s) {
    for (char & c : s) c = (char) std::tolower((unsigned char) c);
    return s;
}

// send or receive n bytes on a non-blocking socket within a deadline
bool io_all(int fd, void * buf, size_t n, bool out, int timeout_ms) {
    uint8_t * p = (uint8_t *) buf;
    while (n > 0) {
        pollfd pf = {fd, (short) (out ? POLLOUT : POLLIN), 0};
        const int r = poll(&pf, 1, timeout_ms);
        if (r <= 0) return false;  // timed out, or failed
        const ssize_t k = out ? send(fd, p, n, MSG_NOSIGNAL) : recv(fd, p, n, 0);
        if (k < 0 && (errno == EINTR || errno == EAGAIN)) continue;
        if (k <= 0) return false;  // closed, or failed
        p += k, n -= (size_t) k;
    }
    return true;
}

// the HELLO exchange of ggml's RPC protocol (ggml-rpc.cpp of the pinned
// source): | cmd 14 | u64 24 | 24 bytes of transport caps (none) |, answered
// by | u64 28 | major, minor, patch, pad, 24 caps |
std::string rpc_hello(int fd, bool * waiting) {
    const int t = 3000;  // 3 s: a loopback or LAN server answers in far less
    uint8_t req[1 + 8 + 24] = {14};
    const uint64_t req_size = 24;
    std::memcpy(req + 1, &req_size, 8);
    if (!io_all(fd, req, sizeof(req), true, t)) return "it does not take a request";
    uint64_t size = 0;
    pollfd pf = {fd, POLLIN, 0};
    if (poll(&pf, 1, t) == 0) {
        *waiting = true;
        return "no answer to the RPC handshake within 3 s (a ggml-rpc-server serves one client at a time: is "
               "another connected? or this is not one)";
    }
    if (!io_all(fd, &size, 8, false, t)) return "the handshake was not answered (not a ggml-rpc-server?)";
    if (size != 28) return "an answer that is not ggml's RPC protocol (not a ggml-rpc-server?)";
    uint8_t rsp[28] = {};
    if (!io_all(fd, rsp, sizeof(rsp), false, t)) return "a handshake cut short";
    if (rsp[0] != RPC_PROTO_MAJOR_VERSION || rsp[1] > RPC_PROTO_MINOR_VERSION)
        return "protocol " + std::to_string(rsp[0]) + "." + std::to_string(rsp[1]) + "." + std::to_string(rsp[2]) +
               ", this build speaks " + std::to_string(RPC_PROTO_MAJOR_VERSION) + "." +
               std::to_string(RPC_PROTO_MINOR_VERSION);
    return {};
}

// ggml-rpc aborts the process (or waits forever) when the endpoint is not a
// working rpc-server: try it first, bounded (a TCP connect, then the protocol's
// HELLO on that connection) so that a wrong address or a server of another kind
// or version is an error message. A server that answers HELLO and fails later
// is beyond this check
void check_reachable(const std::string & host, const std::string & port, const std::string & endpoint) {
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo * res = nullptr;
    const int rc = getaddrinfo(host.c_str(), port.c_str(), &hints, &res);
    if (rc != 0) throw error("rpc-server " + endpoint + ": cannot resolve '" + host + "': " + gai_strerror(rc));
    std::string why = "no address";
    bool ok = false, spoke = false;
    for (addrinfo * a = res; a && !ok; a = a->ai_next) {
        const int fd = socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK, a->ai_protocol);
        if (fd < 0) continue;
        int err = 0;
        if (connect(fd, a->ai_addr, a->ai_addrlen) != 0) {
            err = errno;
            if (err == EINPROGRESS) {
                pollfd p = {fd, POLLOUT, 0};
                const int n = poll(&p, 1, 3000);
                socklen_t len = sizeof(err);
                if (n == 1)
                    getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
                else
                    err = n == 0 ? ETIMEDOUT : errno;
            }
        }
        bool waiting = false;
        if (err == 0) {
            spoke = true;
            why = rpc_hello(fd, &waiting);
            ok = why.empty();
        } else if (!spoke) {
            why = std::strerror(err);
        }
        if (waiting) {
            // a busy ggml-rpc-server answers the HELLO when its client leaves,
            // and dies of SIGPIPE if nobody is there to read it: someone is
            std::thread([fd] {
                pollfd pf = {fd, POLLIN, 0};
                if (poll(&pf, 1, 3600 * 1000) == 1) {
                    uint8_t rsp[8 + 28];
                    io_all(fd, rsp, sizeof(rsp), false, 3000);
                }
                close(fd);
            }).detach();
        } else {
            close(fd);
        }
    }
    freeaddrinfo(res);
    if (!ok && spoke) throw error("rpc-server at " + endpoint + " is not usable: " + why);
    if (!ok)
        throw error("cannot reach rpc-server at " + endpoint + ": " + why +
                    " (start it with: ggml-rpc-server -H HOST -p PORT)");
}

// the first registered device whose registry is named reg_name (CUDA, …)
ggml_backend_dev_t first_of(const char * reg_name) {
    for (size_t i = 0; i < ggml_backend_dev_count(); ++i) {
        ggml_backend_dev_t d = ggml_backend_dev_get(i);
        if (lower(ggml_backend_reg_name(ggml_backend_dev_backend_reg(d))) == lower(reg_name)) return d;
    }
    return nullptr;
}

std::string known_devices() {
    std::string s;
    for (const std::string & d : backend_device_list()) s += (s.empty() ? "" : ", ") + d.substr(0, d.find(':'));
    return s;
}

}  // namespace

ggml_backend_dev_t backend_add_rpc_server(const std::string & endpoint) {
    backend_init();
    const size_t colon = endpoint.rfind(':');
    const std::string host = colon == std::string::npos ? "" : endpoint.substr(0, colon);
    const std::string port = colon == std::string::npos ? "" : endpoint.substr(colon + 1);
    bool digits = !port.empty() && port.size() <= 5;
    for (char c : port) digits = digits && c >= '0' && c <= '9';
    if (host.empty() || !digits || std::stoi(port) < 1 || std::stoi(port) > 65535 ||
        host.find(':') != std::string::npos)
        throw device_error("rpc endpoint '" + endpoint + "' is not HOST:PORT (e.g. 127.0.0.1:50052)");
    ggml_backend_reg_t rpc = ggml_backend_reg_by_name("RPC");
    if (!rpc) throw device_error("this build has no RPC backend (ggml was built without GGML_RPC)");
    using add_server_fn = ggml_backend_reg_t (*)(const char * endpoint);
    auto add = (add_server_fn) ggml_backend_reg_get_proc_address(rpc, "ggml_backend_rpc_add_server");
    if (!add) throw device_error("the RPC backend of this build cannot add servers");

    static std::mutex mtx;
    static std::map<std::string, ggml_backend_dev_t> registered;  // endpoint -> its first device
    std::lock_guard<std::mutex> lock(mtx);
    if (auto it = registered.find(endpoint); it != registered.end()) return it->second;
    check_reachable(host, port, endpoint);
    ggml_backend_reg_t reg = add(endpoint.c_str());
    if (!reg || ggml_backend_reg_dev_count(reg) == 0) throw error("rpc-server at " + endpoint + " offers no device");
    // registered once, so its devices get names (RPC0, …) in --list-devices and --device
    ggml_backend_register(reg);
    return registered[endpoint] = ggml_backend_reg_dev_get(reg, 0);
}

std::vector<std::string> backend_device_list() {
    backend_init();
    std::vector<std::string> out;
    for (size_t i = 0; i < ggml_backend_dev_count(); ++i) {
        ggml_backend_dev_t d = ggml_backend_dev_get(i);
        out.push_back(std::string(ggml_backend_dev_name(d)) + ": " + ggml_backend_dev_description(d));
    }
    return out;
}

std::string backend_device_label(ggml_backend_dev_t dev) {
    if (!dev) return "none";
    const std::string name = ggml_backend_dev_name(dev), desc = ggml_backend_dev_description(dev);
    return desc.empty() || desc == name ? name : name + " (" + desc + ")";
}

ggml_backend_dev_t device_resolve(const model_params & p, int64_t n_layer) {
    ggml_backend_dev_t cpu = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    if (!cpu) throw error("no ggml CPU device is registered");
    if (p.n_gpu_layers < -1)
        throw device_error("n_gpu_layers must be -1 (all), 0 (none) or a layer count, got " +
                           std::to_string(p.n_gpu_layers));
    if (p.n_gpu_layers > 0 && p.n_gpu_layers < n_layer)
        throw error(
            "-ngl " + std::to_string(p.n_gpu_layers) + " would split the model's " + std::to_string(n_layer) +
            " layers between two devices; kvblend runs every layer on one device: use -ngl 0 (CPU) or -ngl all");
    const std::string d = lower(p.device);
    // the name is checked whatever -ngl says: a typo is an error, not a run elsewhere
    ggml_backend_dev_t named = nullptr;
    if (d.rfind("rpc:", 0) == 0) {
        named = backend_add_rpc_server(p.device.substr(4));
    } else if (d == "cuda") {
        if (!ggml_backend_reg_by_name("CUDA"))
            throw device_error("this build has no CUDA backend (build with KVBLEND_CUDA=1)");
        named = first_of("CUDA");
        if (!named && p.use_gpu && p.n_gpu_layers != 0) throw error("no CUDA device found");
    } else if (!d.empty() && d != "cpu" && d != "none") {
        named = ggml_backend_dev_by_name(p.device.c_str());
        if (!named)
            throw device_error("unknown device '" + p.device + "' (devices: " + known_devices() +
                               "; cpu, cuda, rpc:HOST:PORT)");
    }
    // -ngl 0 keeps every layer on the CPU, whatever the device (as in llama.cpp)
    if (!p.use_gpu || p.n_gpu_layers == 0 || d == "cpu" || d == "none") return cpu;
    if (named) return named;
    ggml_backend_dev_t gpu = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_GPU);  // "": auto
    return gpu ? gpu : cpu;
}

}  // namespace kvblend
