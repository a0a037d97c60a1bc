// kvblend tests: a real Redis Cluster on loopback: three primaries, each with
// a replica, made by redis-cli --cluster create, and the redis-cli calls a
// test needs to move a slot, fail a primary over or read a node's role.
#pragma once

#include <chrono>
#include <cstdio>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "store/redis_server.h"

namespace kvblend::test {

// what redis-cli prints for a command to 127.0.0.1:port (its words passed
// quoted: they are ours, with no quotes in them); "" when it cannot run
inline std::string redis_cli(int port, const std::vector<std::string> & args) {
    std::string cmd = "redis-cli -h 127.0.0.1 -p " + std::to_string(port);
    for (const std::string & a : args) cmd += " '" + a + "'";
    cmd += " 2>&1";
    FILE * f = ::popen(cmd.c_str(), "r");
    if (!f) return "";
    std::string out;
    char buf[4096];
    for (size_t n; (n = std::fread(buf, 1, sizeof(buf), f)) > 0;) out.append(buf, n);
    ::pclose(f);
    while (!out.empty() && (out.back() == '\n' || out.back() == '\r')) out.pop_back();
    return out;
}

class redis_cluster {
  public:
    // 3 primaries and 3 replicas; a node silent for node_timeout_ms is failed over
    explicit redis_cluster(int node_timeout_ms = 1000) {
        for (int i = 0; i < 6; ++i)
            nodes_.push_back(
                std::make_unique<redis_server>(0, "", std::vector<std::string>{"127.0.0.1"},
                                               std::vector<std::pair<std::string, std::string>>{
                                                   {"--cluster-enabled", "yes"},
                                                   {"--cluster-config-file", "nodes.conf"},
                                                   {"--cluster-node-timeout", std::to_string(node_timeout_ms)},
                                               }));
        std::vector<std::string> args = {"--cluster", "create"};
        for (const auto & n : nodes_) args.push_back("127.0.0.1:" + std::to_string(n->port()));
        for (const char * a : {"--cluster-replicas", "1", "--cluster-yes"}) args.push_back(a);
        const std::string out = redis_cli(nodes_[0]->port(), args);
        if (out.find("[OK] All 16384 slots covered") == std::string::npos)
            throw std::runtime_error("redis-cli --cluster create failed:\n" + out);
        if (!wait_ok()) throw std::runtime_error("the cluster did not come up");
    }

    // redis-cluster:// with one seed (the first node)
    std::string uri() const { return "redis-cluster://127.0.0.1:" + std::to_string(nodes_[0]->port()); }
    redis_server & node(size_t i) { return *nodes_[i]; }
    size_t size() const { return nodes_.size(); }

    // the port of the primary serving slot by node asked's map (0: none)
    int primary_of_slot(int slot, size_t asked = 0) const { return owner_by_nodes(slot, asked); }

    // "master" or "slave" (INFO replication's role), "" when it does not answer
    static std::string role(int port) { return info_field(port, "replication", "role"); }
    // a replica's primary port (0 for a primary)
    static int master_port(int port) {
        const std::string p = info_field(port, "replication", "master_port");
        return p.empty() ? 0 : std::stoi(p);
    }
    static std::string info_field(int port, const std::string & section, const std::string & field) {
        const std::string out = redis_cli(port, {"INFO", section});
        const size_t at = out.find(field + ":");
        if (at == std::string::npos) return "";
        const size_t end = out.find_first_of("\r\n", at);
        return out.substr(at + field.size() + 1, end - at - field.size() - 1);
    }
    std::string id(int port) const { return redis_cli(port, {"CLUSTER", "MYID"}); }

    // the node index of port
    size_t index_of(int port) const {
        for (size_t i = 0; i < nodes_.size(); ++i)
            if (nodes_[i]->port() == port) return i;
        throw std::runtime_error("no node on port " + std::to_string(port));
    }
    // the replica of the primary on port (its index)
    size_t replica_of(int primary_port) const {
        for (size_t i = 0; i < nodes_.size(); ++i)
            if (nodes_[i]->running() && master_port(nodes_[i]->port()) == primary_port) return i;
        throw std::runtime_error("no replica of " + std::to_string(primary_port));
    }

    // node i is a primary (after a failover), within timeout
    bool wait_primary(size_t i, std::chrono::seconds timeout = std::chrono::seconds(20)) const {
        const auto deadline = std::chrono::steady_clock::now() + timeout;
        while (role(nodes_[i]->port()) != "master") {
            if (std::chrono::steady_clock::now() > deadline) return false;
            std::this_thread::sleep_for(std::chrono::milliseconds(50));
        }
        return true;
    }

    // every running node says cluster_state:ok and agrees on who serves each
    // slot, within timeout
    bool wait_ok(std::chrono::seconds timeout = std::chrono::seconds(30)) const {
        const auto deadline = std::chrono::steady_clock::now() + timeout;
        while (std::chrono::steady_clock::now() < deadline) {
            bool ok = true;
            for (const auto & n : nodes_)
                if (n->running() && info_cluster_state(n->port()) != "ok") ok = false;
            if (ok) return true;
            std::this_thread::sleep_for(std::chrono::milliseconds(100));
        }
        return false;
    }
    static std::string info_cluster_state(int port) {
        const std::string out = redis_cli(port, {"CLUSTER", "INFO"});
        const size_t at = out.find("cluster_state:");
        if (at == std::string::npos) return "";
        return out.substr(at + 14, out.find_first_of("\r\n", at) - at - 14);
    }

  private:
    std::vector<std::unique_ptr<redis_server>> nodes_;

    // the primary whose CLUSTER NODES line lists slot (asked: the node read)
    int owner_by_nodes(int slot, size_t asked) const {
        const std::string out = redis_cli(nodes_[asked]->port(), {"CLUSTER", "NODES"});
        size_t b = 0;
        while (b < out.size()) {
            const size_t e = std::min(out.find('\n', b), out.size());
            const std::string line = out.substr(b, e - b);
            b = e + 1;
            // <id> <ip:port@cport> <flags> <master> <ping> <pong> <epoch> <state> <slot ranges…>
            std::vector<std::string> w;
            for (size_t i = 0; i <= line.size();) {
                const size_t j = std::min(line.find(' ', i), line.size());
                if (j > i) w.push_back(line.substr(i, j - i));
                i = j + 1;
            }
            if (w.size() < 9 || w[2].find("master") == std::string::npos || w[2].find("fail") != std::string::npos)
                continue;
            for (size_t k = 8; k < w.size(); ++k) {
                if (w[k][0] == '[') continue;  // a slot being moved
                const size_t dash = w[k].find('-');
                const int lo = std::stoi(w[k].substr(0, dash));
                const int hi = dash == std::string::npos ? lo : std::stoi(w[k].substr(dash + 1));
                if (slot >= lo && slot <= hi) {
                    const size_t colon = w[1].find(':'), at = w[1].find('@');
                    return std::stoi(w[1].substr(colon + 1, at - colon - 1));
                }
            }
        }
        return 0;
    }
};

}  // namespace kvblend::test
