// the HTTP layer of the server: cpp-httplib's router and response writer, with
// the connection handling a public endpoint needs. Each connection holds one
// thread (a blocked thread costs little) up to max_connections, and a client
// that sends its request slowly is cut off at a deadline instead of holding
// its thread for good; requests pipelined on a connection are all answered.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "httplib.h"

namespace kvblend {

struct http_limits {
    size_t max_body = 8u << 20;           // bytes of a request body; longer ones get 413
    int read_timeout_s = 15;              // a request's line, headers and body must all arrive within this
    int write_timeout_s = 10;             // a response write that makes no progress for this long fails
    int keep_alive_s = 5;                 // an idle connection is closed after this
    int max_connections = 256;            // open connections at once; more are answered 503 and closed
    int max_connections_per_client = 64;  // from one client address; more are answered 429 and closed
};

class http_server : public httplib::Server {
  public:
    explicit http_server(const http_limits & limits);

    int open_connections() const;
    int64_t refused_connections() const;  // answered 429/503 and closed

  private:
    bool process_and_close_socket(socket_t sock) override;

    http_limits limits_;
    mutable std::mutex mu_;
    int open_ = 0;
    int64_t refused_ = 0;
    std::map<std::string, int> open_by_client_;
};

// "Authorization: Bearer KEY"; the scheme in any case (RFC 7235)
bool http_bearer_matches(const httplib::Request & req, const std::string & key);
// the key as "Authorization: Bearer KEY" or as "X-Api-Key: KEY" (what some clients send)
bool http_key_matches(const httplib::Request & req, const std::string & key);

// whether the client can read a chunked response (HTTP/1.1 and later)
bool http_can_chunk(const httplib::Request & req);

// whether a web page of `origin` (an Origin header's value) may call the server:
// a loopback origin, one listed, or any when the list holds "*"
bool http_origin_allowed(const std::string & origin, const std::vector<std::string> & allowed);

}  // namespace kvblend
