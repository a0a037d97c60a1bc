// kvblend off the host: the model's weights, KV caches and the blend's hidden
// states on ggml's RPC backend, a ggml-rpc-server on loopback that this test
// starts (tests/rpc/rpc_server.h). the RPC device's memory is another
// process's, as a GPU's is behind its API: any read or write through a raw
// tensor->data pointer fails here, where the CPU tests cannot see it.
// references: libllama on the CPU, and our own CPU path.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <thread>

#include "blend/blend_prompt.h"
#include "cli_run.h"
#include "httplib.h"
#include "kvblend.h"
#include "kvblend/blend.h"
#include "kvblend/rag.h"
#include "kvblend/server.h"
#include "kvblend/store.h"
#include "kvblend/vocab.h"
#include "ref/llama_ref.h"
#include "rpc/rpc_server.h"
#include "test_util.h"

namespace kvblend {
namespace {

using test::collect_all;
using test::f32_params;
using test::pointers;
using test::prompt;

using json = nlohmann::json;
const std::string k_stories = std::string(KVBLEND_TEST_MODELS) + "/stories260K.gguf";

const std::string k_story =
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the park with her friends. "
    "One day, she saw a big red ball under a tree. She ran to the ball and picked it up. Her friend Tom came over and "
    "said, \"Can I play with the ball too?\" Lily smiled and said yes. They played all day until the sun went down.";
const std::vector<std::string> k_docs = {
    " Tom had a red ball. He liked to throw it high in the sky. One day the ball went over the fence and Tom was sad.",
    " Sue found a little cat in the garden. The cat was hungry, so Sue gave it some milk. They became best friends.",
    " The sun was hot and Ben wanted to swim. His mom took him to the lake. Ben splashed and laughed all day.",
};
const std::string k_query = " Once upon a time, the friends met in the park and";

// one server per test process (ctest runs every test in a process of its own)
test::rpc_server & rpc() {
    static test::rpc_server s;
    return s;
}

std::shared_ptr<model> load_on_rpc(const std::string & path) {
    model_params mp;
    mp.device = rpc().device();
    return model::load(path, mp);
}

std::shared_ptr<model> load_on_cpu(const std::string & path) {
    model_params mp;
    mp.device = "cpu";
    return model::load(path, mp);
}

std::vector<std::string> models_under_test() {
    return {k_stories, test::make_test_model("tiny-qwen3")};
}

prompt make_prompt(const model & m) {
    prompt p;
    p.chunks.push_back(m.tokens().tokenize("Here are some stories.", true));
    for (const std::string & d : k_docs) p.chunks.push_back(m.tokens().tokenize(d, false));
    p.query = m.tokens().tokenize(k_query, false);
    return p;
}

bool on_host(const ggml_tensor * t) {
    return t->buffer && ggml_backend_buffer_is_host(t->buffer);
}

TEST(rpc, weights_and_caches_live_on_the_rpc_device) {
    auto m = load_on_rpc(k_stories);
    EXPECT_TRUE(m->on_gpu());
    EXPECT_NE(m->device_label().find(rpc().endpoint()), std::string::npos) << m->device_label();
    EXPECT_FALSE(on_host(m->tok_embd));
    EXPECT_FALSE(on_host(m->layers[0].wq));
    engine e(m, f32_params());
    EXPECT_FALSE(on_host(e.cache().k(0)));
    EXPECT_FALSE(on_host(e.cache().v(m->hparams().n_layer - 1)));
    // the same model on the CPU is in host memory (the check above can fail)
    auto c = load_on_cpu(k_stories);
    EXPECT_FALSE(c->on_gpu());
    EXPECT_TRUE(on_host(c->tok_embd));
}

TEST(rpc, forward_equals_cpu_libllama) {
    for (const std::string & path : models_under_test()) {
        auto m = load_on_rpc(path);
        std::vector<llama_token> toks =
            path == k_stories ? m->tokens().tokenize(k_story, true) : test::random_tokens(*m, 72, 7);
        toks.resize(std::min<size_t>(toks.size(), 72));
        ASSERT_GE(toks.size(), 64u);
        engine e(m, f32_params(256));
        const std::vector<float> ours = e.eval(toks, true);

        ref::llama_ref_params rp;
        rp.n_ctx = 256;
        rp.type_k = rp.type_v = GGML_TYPE_F32;
        rp.flash_attn = false;
        rp.extra_bufts = false;
        rp.use_gpu = false;  // the CPU reference, though the RPC device is registered now
        ref::llama_ref lr(path, rp);
        const std::vector<float> theirs = lr.eval(toks, true);
        const double d = test::max_rel_diff(ours, theirs);
        std::printf("[ %s ] rpc forward vs CPU libllama: logits relative %.3g\n", path.c_str(), d);
        EXPECT_LE(d, 1e-4);

        // decode on the device (the reused decode graph included) == libllama's greedy
        sampler_params greedy;
        greedy.temp = 0;
        const std::vector<float> last(ours.end() - m->hparams().n_vocab, ours.end());
        const generate_result g = e.generate_from(last, 16, greedy);
        const std::vector<llama_token> ref_toks =
            lr.greedy(std::vector<float>(theirs.end() - m->hparams().n_vocab, theirs.end()), 16);
        ASSERT_FALSE(g.tokens.empty());
        for (size_t i = 0; i < g.tokens.size(); ++i) EXPECT_EQ(g.tokens[i], ref_toks[i]) << path << " token " << i;
    }
}

TEST(rpc, gradual_equals_dense) {
    for (const std::string & path : models_under_test()) {
        auto m = load_on_rpc(path);
        const prompt p = make_prompt(*m);
        engine coll(m, f32_params());
        const std::vector<chunk_kv> kv = collect_all(coll, p);
        const std::vector<const chunk_kv *> ptrs = pointers(kv);

        blend_params bp;
        bp.recomp_ratio = 0.3f;
        engine eg(m, f32_params()), ed(m, f32_params());
        bp.method = BLEND_METHOD_GRADUAL;
        const engine::transfer_stats t0 = eg.transfers();
        const blend_result g = blend(eg, ptrs, p.query, bp);
        EXPECT_EQ(eg.transfers().hidden, t0.hidden) << "hidden states crossed to the host";
        bp.method = BLEND_METHOD_DENSE;
        const blend_result d = blend(ed, ptrs, p.query, bp);
        EXPECT_EQ(g.selected, d.selected);
        EXPECT_LE(test::max_rel_diff(g.logits, d.logits), 1e-5) << path;
        const int64_t N = g.stats.n_tokens;
        for (int il = 0; il < m->hparams().n_layer; ++il) {
            EXPECT_LE(test::max_rel_diff(eg.cache().read_k(il, 0, N), ed.cache().read_k(il, 0, N)), 1e-5) << il;
            EXPECT_LE(test::max_rel_diff(eg.cache().read_v(il, 0, N), ed.cache().read_v(il, 0, N)), 1e-5) << il;
        }
        EXPECT_LT(g.stats.deep_frac, 1.0);
    }
}

TEST(rpc, ratio_one_equals_full_prefill) {
    for (const std::string & path : models_under_test()) {
        auto m = load_on_rpc(path);
        const prompt p = make_prompt(*m);
        engine coll(m, f32_params());
        const std::vector<chunk_kv> kv = collect_all(coll, p);
        const std::vector<const chunk_kv *> ptrs = pointers(kv);

        engine e(m, f32_params());
        blend_params bp;
        bp.recomp_ratio = 1.0f;
        const blend_result r = blend(e, ptrs, p.query, bp);
        engine full(m, f32_params());
        const std::vector<float> ref = full.eval(p.all());
        const double d = test::max_rel_diff(r.logits, ref);
        std::printf("[ %s ] rpc ratio 1 vs full prefill: logits relative %.3g\n", path.c_str(), d);
        EXPECT_LE(d, 1e-4);
        const int64_t N = (int64_t) p.all().size();
        for (int il = 0; il < m->hparams().n_layer; ++il) {
            EXPECT_LE(test::max_rel_diff(e.cache().read_k(il, 0, N), full.cache().read_k(il, 0, N)), 1e-4) << il;
            EXPECT_LE(test::max_rel_diff(e.cache().read_v(il, 0, N), full.cache().read_v(il, 0, N)), 1e-4) << il;
        }
    }
}

// chunks collected on the device go to a store and come back onto it; the
// blend over them equals the CPU's blend over chunks collected on the CPU
TEST(rpc, blend_from_stored_chunks_equals_the_cpu_blend) {
    for (const std::string & path : models_under_test()) {
        test::temp_dir dir("rpcstore");
        auto st = store_open(dir.path().string());
        auto m = load_on_rpc(path);
        const prompt p = make_prompt(*m);
        blend_params bp;
        bp.recomp_ratio = 0.3f;

        chunk_fetch_stats fs;
        {
            engine coll(m, f32_params());
            for (const auto & c : p.chunks) chunk_get_or_collect(st.get(), coll, {}, c, fs);
        }
        EXPECT_EQ(fs.misses, (int64_t) p.chunks.size());
        engine e(m, f32_params());
        std::vector<chunk_kv> kv;
        for (const auto & c : p.chunks) kv.push_back(chunk_get_or_collect(st.get(), e, {}, c, fs));
        EXPECT_EQ(fs.hits, (int64_t) p.chunks.size());
        const blend_result r = blend(e, pointers(kv), p.query, bp);

        auto mc = load_on_cpu(path);
        engine ce(mc, f32_params());
        const std::vector<chunk_kv> ckv = collect_all(ce, p);
        const std::vector<const chunk_kv *> cptrs = pointers(ckv);
        // the KV that came back from the store is the CPU's KV
        for (size_t i = 0; i < kv.size(); ++i) {
            ASSERT_EQ(kv[i].bytes(), ckv[i].bytes());
            const size_t nf = kv[i].bytes() / sizeof(float);
            const std::vector<float> a((const float *) kv[i].k(0), (const float *) kv[i].k(0) + nf);
            const std::vector<float> b((const float *) ckv[i].k(0), (const float *) ckv[i].k(0) + nf);
            EXPECT_LE(test::max_rel_diff(a, b), 1e-5) << path << " chunk " << i;
        }
        const blend_result rc = blend(ce, cptrs, p.query, bp);
        EXPECT_EQ(r.selected, rc.selected) << path;
        const double d = test::max_rel_diff(r.logits, rc.logits);
        std::printf("[ %s ] rpc blend from the store vs CPU blend: logits relative %.3g\n", path.c_str(), d);
        EXPECT_LE(d, 1e-4);
    }
}

// the device tier keeps hot chunks on the RPC device, in the cache's layout:
// a repeated request moves only its inputs and read-backs over the link, no
// chunk rows, and fuses as from host rows
TEST(rpc, a_hot_request_moves_no_chunk_bytes_over_the_link) {
    auto m = load_on_rpc(k_stories);
    engine e(m, f32_params());
    const rag_prompt rp = rag_prompt_build(m->tokens(), "Here are some stories.", k_docs, k_query, false);
    chunk_tier_params tp;
    tp.dev = m->device();
    tp.n_head_kv = m->hparams().n_head_kv;
    std::vector<float> logits;
    uint64_t moved[2] = {0, 0}, placed = 0;
    for (int dev : {0, 1}) {
        tp.host_bytes = dev ? 0 : 64 << 20;
        tp.dev_bytes = dev ? 64 << 20 : 0;
        chunk_tiers tiers(tp);
        rag_fuse_params p;
        p.tiers = &tiers;
        rag_fuse(e, rp, p);  // collected, kept
        const uint64_t t0 = e.transfers().to_backend;
        const rag_fuse_result hot = rag_fuse(e, rp, p);
        moved[dev] = e.transfers().to_backend - t0;
        EXPECT_EQ(dev ? hot.fetch.hits_dev : hot.fetch.hits_host, (int64_t) rp.chunks.size());
        if (logits.empty()) logits = hot.logits;
        EXPECT_EQ(hot.logits, logits);  // the same arithmetic on the same device
        if (!dev) {
            // the rows a placement uploads: every chunk's K and V below the check layer's recompute
            const int l0 = blend_default_params().check_layer;
            for (const auto & c : rp.chunks)
                for (int il = l0; il < m->hparams().n_layer_kv; ++il)
                    placed += 2 * (uint64_t) c.size() * ggml_row_size(GGML_TYPE_F32, m->hparams().n_embd_kv(il));
        }
    }
    std::printf(
        "[ rpc ] a hot request sends %llu bytes to the device from the host tier, %llu from the device "
        "tier (chunk rows: %llu)\n",
        (unsigned long long) moved[0], (unsigned long long) moved[1], (unsigned long long) placed);
    EXPECT_EQ(moved[0] - moved[1], placed);
}

json post(httplib::Client & c, const json & body) {
    auto r = c.Post("/v1/chat/completions", body.dump(), "application/json");
    EXPECT_TRUE(r);
    if (!r) return json();
    EXPECT_EQ(r->status, 200) << r->body;
    return json::parse(r->body);
}

// the chat answer with documents, from a server whose model is on dev
std::vector<json> chat_twice(std::shared_ptr<model> m, const std::string & store_dir) {
    server_params sp;
    sp.port = 0;
    sp.n_ctx = 512;
    sp.store_uri = store_dir;
    server srv(std::move(m), sp);
    std::thread t([&] { srv.listen(); });
    std::vector<json> out;
    if (srv.wait_ready(10000)) {
        httplib::Client c("127.0.0.1", srv.port());
        c.set_read_timeout(60, 0);
        auto body = [](const json & docs, const std::string & q) {
            return json{
                {"messages", {{{"role", "system"}, {"content", "Stories:"}}, {{"role", "user"}, {"content", q}}}},
                {"documents", docs},
                {"max_tokens", 12},
                {"temperature", 0}};
        };
        out.push_back(post(c, body({{{"text", k_docs[0]}}, {{"text", k_docs[1]}}, {{"text", k_docs[2]}}}, k_query)));
        // another question over the documents in another order: from the store
        out.push_back(
            post(c, body({{{"text", k_docs[2]}}, {{"text", k_docs[0]}}, {{"text", k_docs[1]}}}, " The next day")));
    }
    srv.stop();
    t.join();
    return out;
}

TEST(rpc, server_chat_with_documents_equals_the_cpu_server) {
    test::temp_dir d1("rpcsrv"), d2("cpusrv");
    const std::vector<json> r = chat_twice(load_on_rpc(k_stories), d1.path().string());
    const std::vector<json> c = chat_twice(load_on_cpu(k_stories), d2.path().string());
    ASSERT_EQ(r.size(), 2u);
    ASSERT_EQ(c.size(), 2u);
    EXPECT_EQ(r[0]["kvblend"]["store_hits"], 0);
    EXPECT_EQ(r[1]["kvblend"]["store_hits"], 4);  // the prefix and the three documents
    EXPECT_GT(r[0]["kvblend"]["n_fused"].get<int>(), 0);
    for (int i = 0; i < 2; ++i) {
        const std::string text = r[i]["choices"][0]["message"]["content"];
        EXPECT_FALSE(text.empty()) << i;
        EXPECT_EQ(c[i]["choices"][0]["message"]["content"], text) << i;
        EXPECT_EQ(c[i]["kvblend"]["n_recomputed"], r[i]["kvblend"]["n_recomputed"]) << i;
    }
}

TEST(rpc, live_compressed_cache_is_refused_naming_the_backend) {
    auto m = load_on_rpc(k_stories);
    for (const char * codec : {"turboquant4", "minicache"}) {
        engine_params ep;
        ep.kv_codec = codec;
        try {
            engine e(m, ep);
            ADD_FAILURE() << codec << " was accepted on " << m->device_label();
        } catch (const error & e) {
            const std::string msg = e.what();
            EXPECT_NE(msg.find("RPC"), std::string::npos) << msg;
            EXPECT_NE(msg.find(rpc().endpoint()), std::string::npos) << msg;
            EXPECT_NE(msg.find("CPU"), std::string::npos) << msg;
        }
    }
    // the same on the CPU runs
    engine_params ep;
    ep.kv_codec = "turboquant4";
    engine ok(load_on_cpu(k_stories), ep);
    EXPECT_NE(ok.live(), nullptr);
}

TEST(rpc, bad_devices_are_errors) {
    model_params mp;
    for (const std::string & d :
         {std::string("rpc:127.0.0.1"), std::string("rpc:127.0.0.1:99999"), std::string("rpc::50052"),
          std::string("rpc:127.0.0.1:x"), std::string("no-such-device")}) {
        mp.device = d;
        EXPECT_THROW(model::load(k_stories, mp), error) << d;
    }
    // a port nothing listens on: a message, not ggml-rpc's abort
    const int port = [] {
        test::rpc_server s;  // a port that was free a moment ago
        return s.port();
    }();
    mp.device = "rpc:127.0.0.1:" + std::to_string(port);
    try {
        model::load(k_stories, mp);
        ADD_FAILURE() << "a closed port was accepted";
    } catch (const error & e) {
        EXPECT_NE(std::string(e.what()).find("cannot reach rpc-server at 127.0.0.1:" + std::to_string(port)),
                  std::string::npos)
            << e.what();
    }
    // -ngl: 0 keeps the model on the CPU, a split is refused, all is the device
    mp.device = rpc().device();
    mp.n_gpu_layers = 0;
    EXPECT_FALSE(model::load(k_stories, mp)->on_gpu());
    mp.n_gpu_layers = 2;
    EXPECT_THROW(model::load(k_stories, mp), error);
    mp.n_gpu_layers = 99;
    EXPECT_TRUE(model::load(k_stories, mp)->on_gpu());
}

// a port that accepts but is no ggml-rpc-server: it hangs up, answers
// garbage, or says nothing. Each is an error within seconds, not ggml-rpc's
// abort of the whole process or a wait forever
struct fake_endpoint {
    enum kind { hang_up, garbage, silent } k;
    int fd = -1, port = 0;
    std::thread th;
    std::atomic<bool> stop{false};

    explicit fake_endpoint(kind kk) : k(kk) {
        fd = socket(AF_INET, SOCK_STREAM, 0);
        sockaddr_in a{};
        a.sin_family = AF_INET;
        a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        bind(fd, (sockaddr *) &a, sizeof(a));
        socklen_t len = sizeof(a);
        getsockname(fd, (sockaddr *) &a, &len);
        port = ntohs(a.sin_port);
        listen(fd, 8);
        th = std::thread([this] {
            while (!stop) {
                pollfd p = {fd, POLLIN, 0};
                if (poll(&p, 1, 100) != 1) continue;
                const int c = accept(fd, nullptr, nullptr);
                if (c < 0) continue;
                if (k == garbage) {
                    char in[64];
                    (void) !recv(c, in, sizeof(in), 0);
                    const char out[] = "HTTP/1.1 400 Bad Request\r\n\r\nnot rpc at all, no sir";
                    (void) !send(c, out, sizeof(out), MSG_NOSIGNAL);
                }
                if (k == silent)
                    for (int i = 0; i < 60 && !stop; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(100));
                close(c);
            }
        });
    }
    ~fake_endpoint() {
        stop = true;
        th.join();
        close(fd);
    }
};

TEST(rpc, an_endpoint_that_is_no_rpc_server_is_an_error_not_an_abort) {
    for (const auto k : {fake_endpoint::hang_up, fake_endpoint::garbage, fake_endpoint::silent}) {
        fake_endpoint f(k);
        model_params mp;
        mp.device = "rpc:127.0.0.1:" + std::to_string(f.port);
        const auto t0 = std::chrono::steady_clock::now();
        try {
            model::load(k_stories, mp);
            ADD_FAILURE() << "a fake rpc-server was accepted (kind " << k << ")";
        } catch (const error & e) {
            EXPECT_NE(std::string(e.what()).find("is not usable"), std::string::npos) << e.what();
        }
        EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(10)) << "kind " << k;
    }
}

// a ggml-rpc-server serves one client at a time: while another holds it, the
// HELLO gets no answer. That is an error naming the likely cause, and the
// server, which answers the abandoned HELLO once the other client leaves,
// finds someone there to read it (it died of SIGPIPE before) and serves on
TEST(rpc, a_busy_rpc_server_is_an_error_and_outlives_the_probe) {
    test::rpc_server srv;
    const int other = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons((uint16_t) srv.port());
    ASSERT_EQ(connect(other, (sockaddr *) &a, sizeof(a)), 0);
    uint8_t hello[1 + 8 + 24] = {14};
    const uint64_t n = 24;
    std::memcpy(hello + 1, &n, 8);
    ASSERT_EQ(send(other, hello, sizeof(hello), MSG_NOSIGNAL), (ssize_t) sizeof(hello));
    uint8_t answer[8 + 28];
    ASSERT_EQ(recv(other, answer, sizeof(answer), MSG_WAITALL),
              (ssize_t) sizeof(answer));  // the other client's session

    model_params mp;
    mp.device = srv.device();
    try {
        model::load(k_stories, mp);
        ADD_FAILURE() << "a busy rpc-server was taken";
    } catch (const error & e) {
        EXPECT_NE(std::string(e.what()).find("is another connected"), std::string::npos) << e.what();
    }
    close(other);
    std::this_thread::sleep_for(std::chrono::milliseconds(1500));
    EXPECT_TRUE(srv.alive()) << "the rpc-server died answering the abandoned handshake";
    EXPECT_TRUE(model::load(k_stories, mp)->on_gpu());
}

// the C API onto the rpc-server (what a C or Python program embedding kvblend
// does): by "rpc:HOST:PORT" and by the name kvb_rpc_add_server gives its
// device; the greedy generation and blend are the CPU's
struct capi_run {
    std::string device, generated, blended;
};

capi_run capi_on(const std::string & device) {
    capi_run r;
    kvb_model_params mp = kvb_model_default_params();
    mp.device = device.c_str();
    kvb_model * m = nullptr;
    kvb_context * c = nullptr;
    if (kvb_model_load(k_stories.c_str(), &mp, &m) != KVB_OK || kvb_context_new(m, nullptr, &c) != KVB_OK) {
        ADD_FAILURE() << device << ": " << kvb_last_error();
        kvb_model_free(m);
        return r;
    }
    kvb_model_info info;
    EXPECT_EQ(kvb_model_get_info(m, &info), KVB_OK);
    r.device = info.device;
    kvb_generate_params gp = kvb_generate_default_params();
    gp.n_predict = 24;
    char * text = nullptr;
    EXPECT_EQ(kvb_generate(c, k_story.c_str(), &gp, &text, nullptr), KVB_OK) << kvb_last_error();
    r.generated = text ? text : "";
    kvb_free(text);
    std::vector<kvb_doc> docs;
    for (const std::string & d : k_docs) docs.push_back({d.c_str(), nullptr});
    kvb_blend_params bp = kvb_blend_default_params();
    bp.recomp_ratio = 0.3f;
    text = nullptr;
    EXPECT_EQ(kvb_blend(c, nullptr, "Here are some stories.", docs.data(), docs.size(), k_query.c_str(), &bp, &gp,
                        &text, nullptr),
              KVB_OK)
        << kvb_last_error();
    r.blended = text ? text : "";
    kvb_free(text);
    kvb_context_free(c);
    kvb_model_free(m);
    return r;
}

TEST(rpc, c_api_on_an_rpc_server_generates_and_blends_the_cpu_text) {
    const capi_run cpu = capi_on("cpu");
    ASSERT_FALSE(cpu.generated.empty());
    ASSERT_FALSE(cpu.blended.empty());
    EXPECT_EQ(cpu.device.rfind("CPU", 0), 0u) << cpu.device;

    const capi_run by_endpoint = capi_on(rpc().device());
    EXPECT_NE(by_endpoint.device.find(rpc().endpoint()), std::string::npos) << by_endpoint.device;
    EXPECT_EQ(by_endpoint.generated, cpu.generated);
    EXPECT_EQ(by_endpoint.blended, cpu.blended);

    // registered: listed, and loadable by its name
    char * name = nullptr;
    ASSERT_EQ(kvb_rpc_add_server(rpc().endpoint().c_str(), &name), KVB_OK) << kvb_last_error();
    const std::string dev = name;
    kvb_free(name);
    EXPECT_EQ(dev.rfind("RPC", 0), 0u) << dev;
    char * list = nullptr;
    ASSERT_EQ(kvb_list_devices(&list), KVB_OK);
    EXPECT_NE(std::string(list).find(dev + ": " + rpc().endpoint()), std::string::npos) << list;
    kvb_free(list);
    const capi_run by_name = capi_on(dev);
    EXPECT_NE(by_name.device.find(rpc().endpoint()), std::string::npos) << by_name.device;
    EXPECT_EQ(by_name.generated, cpu.generated);
    EXPECT_EQ(by_name.blended, cpu.blended);
}

// the CLI, bounded in time whatever the server does (a stuck connection would
// otherwise wait forever)
test::run_result run_cli(const std::string & args) {
    return test::run_cli(args, "timeout -k 5 60 ");
}

// the CLI's llama.cpp-style flags: --device rpc:…, --rpc, -ngl, --list-devices
TEST(rpc, cli_generate_on_rpc_equals_cpu) {
    const std::string base = "generate -m " + k_stories + " -p 'Once upon a time' -n 16 --temp 0 ";
    const test::run_result cpu = run_cli(base + "--device cpu");
    ASSERT_EQ(cpu.status, 0) << cpu.err;
    const test::run_result dev = run_cli(base + "--device " + rpc().device());
    ASSERT_EQ(dev.status, 0) << dev.err;
    EXPECT_EQ(dev.out, cpu.out);
    const test::run_result flag = run_cli(base + "--rpc " + rpc().endpoint() + " -ngl all");
    ASSERT_EQ(flag.status, 0) << flag.err;
    EXPECT_EQ(flag.out, cpu.out);
    const test::run_result list = run_cli("generate --rpc " + rpc().endpoint() + " --list-devices");
    EXPECT_EQ(list.status, 0) << list.err;
    EXPECT_NE(list.out.find("RPC0: " + rpc().endpoint()), std::string::npos) << list.out;
    const test::run_result live = run_cli(base + "--device " + rpc().device() + " --kv-codec turboquant4");
    EXPECT_EQ(live.status, 1);
    EXPECT_NE(live.err.find("error: a live turboquant4 cache"), std::string::npos) << live.err;
    EXPECT_NE(live.err.find(rpc().endpoint()), std::string::npos) << live.err;
    const test::run_result split = run_cli(base + "--device " + rpc().device() + " -ngl 3");
    EXPECT_EQ(split.status, 1);
    EXPECT_NE(split.err.find("error: -ngl 3"), std::string::npos) << split.err;
}

}  // namespace
}  // namespace kvblend
