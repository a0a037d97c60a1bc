// the HTTP layer of the server: requests and responses as plain types, routes
// and hooks over them, and the connection handling a public endpoint needs
// (cpp-httplib parses and writes; nothing outside server_http.cpp sees it).
// Each connection holds one thread (a blocked thread costs little) up to
// max_connections, and a client that sends its request slowly is cut off at a
// deadline instead of holding its thread for good; requests pipelined on a
// connection are all answered.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <regex>
#include <string>
#include <vector>

namespace kvblend {

struct http_limits {
    size_t max_body = 8u << 20;           // bytes of a request body; longer ones get 413
    int read_timeout_s = 15;              // a request's line, headers and body must all arrive within this
    int write_timeout_s = 10;             // a response write that makes no progress for this long fails
    int keep_alive_s = 5;                 // an idle connection is closed after this
    int max_connections = 256;            // open connections at once; more are answered 503 and closed
    int max_connections_per_client = 64;  // from one client address; more are answered 429 and closed
};

// header names compare in any case (RFC 9110)
struct http_name_less {
    bool operator()(const std::string & a, const std::string & b) const;
};
using http_headers = std::multimap<std::string, std::string, http_name_less>;

struct http_request {
    std::string method, path, version;  // version: "HTTP/1.1"
    http_headers headers;
    std::string body;                  // empty before the body is read (on_headers)
    std::vector<std::string> matches;  // the route pattern's groups; [0]: the whole path
    uint64_t content_length = 0;       // the declared Content-Length (0: none)
    std::function<bool()> closed;      // whether the client has hung up (copyable: a stream may keep it)

    bool has_header(const std::string & name) const { return headers.count(name) > 0; }
    std::string header(const std::string & name) const;  // the first value, "" when absent
};

// a body sent while it is made: next() appends the bytes to send now and says
// whether they end it (last); false stops the stream there. cut() runs when a
// stream ends before its last bytes went out (the client left, a write failed)
struct http_stream {
    std::function<bool(std::string & out, bool & last)> next;
    std::function<void()> cut;
};

struct http_response {
    int status = 200;
    std::vector<std::pair<std::string, std::string>> headers;
    std::string content_type, body;
    http_stream stream;  // next set: the body is streamed (without a length; chunked where the client reads chunks)

    void set_header(const std::string & name, const std::string & value) { headers.emplace_back(name, value); }
    void set_content(std::string text, std::string type) {
        body = std::move(text);
        content_type = std::move(type);
    }
    void set_stream(std::string type, http_stream s) {
        content_type = std::move(type);
        stream = std::move(s);
    }
};

using http_handler = std::function<void(const http_request &, http_response &)>;

class http_server {
  public:
    explicit http_server(const http_limits & limits);
    ~http_server();
    http_server(const http_server &) = delete;
    http_server & operator=(const http_server &) = delete;

    // routes: a path, or a regular expression whose groups fill http_request::matches
    void get(const std::string & pattern, http_handler h);
    void post(const std::string & pattern, http_handler h);
    // every request once its headers are read, before its body (and before a
    // "100 Continue"): true when res is the answer; headers it sets stay on the response
    void on_headers(std::function<bool(const http_request &, http_response &)> f);
    // an error response (status 400 and up) without a body: f may give it one
    // (path: the request's). a path that a route serves with another method is a
    // 405 with an Allow header, not a 404
    void on_error(std::function<void(const std::string & path, http_response &)> f);
    // every response, as it is sent
    void on_response(std::function<void(int status)> f);

    int bind_to_any_port(const std::string & host);  // the port, or -1
    bool bind_to_port(const std::string & host, int port);
    bool listen_after_bind();  // serves until stop()
    void stop();
    bool is_running() const;

    int open_connections() const;
    int64_t refused_connections() const;  // answered 429/503 and closed

  private:
    class connections;
    std::unique_ptr<connections> d_;
    std::vector<std::pair<std::string, std::regex>> routes_;  // method, pattern
};

// the reason phrase of a status ("Not Found")
std::string http_status_message(int status);

// "Authorization: Bearer KEY"; the scheme in any case (RFC 7235)
bool http_bearer_matches(const http_request & req, const std::string & key);
// the key as "Authorization: Bearer KEY" or as "X-Api-Key: KEY" (what some clients send)
bool http_key_matches(const http_request & req, const std::string & key);

// whether a web page of `origin` (an Origin header's value) may call the server:
// a loopback origin, one listed, or any when the list holds "*"
bool http_origin_allowed(const std::string & origin, const std::vector<std::string> & allowed);

}  // namespace kvblend
