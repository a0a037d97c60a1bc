// a kvblend server in process, on a free loopback port, for the server tests
#pragma once

#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <thread>

#include "httplib.h"
#include "kvblend/server.h"

namespace kvblend::test {

inline const std::string k_stories_model = std::string(KVBLEND_SHARED_MODELS) + "/stories260K.gguf";

class running_server {
  public:
    explicit running_server(server_params p, const std::string & model_path = k_stories_model) {
        p.port = 0;
        srv_ = std::make_unique<server>(model::load(model_path), p);
        thread_ = std::thread([this] { srv_->listen(); });
        EXPECT_TRUE(srv_->wait_ready(10000));
    }
    ~running_server() {
        srv_->stop();
        thread_.join();
    }
    running_server(const running_server &) = delete;
    running_server & operator=(const running_server &) = delete;

    int port() const { return srv_->port(); }
    httplib::Client client(int read_timeout_s = 60) const {
        httplib::Client c("127.0.0.1", port());
        c.set_read_timeout(read_timeout_s, 0);
        return c;
    }

  private:
    std::unique_ptr<server> srv_;
    std::thread thread_;
};

}  // namespace kvblend::test
