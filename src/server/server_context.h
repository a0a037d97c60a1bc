// the slots and the serving loop: the queue of jobs, each slot's KV cache and
// what it holds, and the one thread that computes every slot's prompt and answer.
//
// one thread serves every slot. each round admits queued requests into free
// slots and runs one step: a single forward (engine::eval_seqs) holding the
// next token of every generating slot and chunks of the plain prompts being
// prefilled, so that the weights are read once per step for all of them
// and a long prompt never stops the other streams. the work that is not
// batched yet (ingest, a blend, and every prompt of a server with a live
// compressed cache or token eviction, whose slots keep an engine each) is
// prepared on a second thread meanwhile, with the slot's cache lent to its
// engine, and the slot joins the steps when it is done
#pragma once

#include <memory>
#include <vector>

#include "kvblend/model.h"
#include "kvblend/server.h"
#include "server/server_job.h"
#include "server/server_metrics.h"
#include "server/soft_store.h"

namespace kvblend {

class server_context {
  public:
    // every slot's memory is allocated here, before serving; st: the server's
    // store (null: none), tiers: the hot chunks in front of it (not null),
    // metrics: where each request is counted when it ends
    server_context(std::shared_ptr<const model> m, const server_params & p, soft_store * st, chunk_tiers * tiers,
                   server_metrics & metrics);
    // answers every queued request, then stops
    ~server_context();
    server_context(const server_context &) = delete;
    server_context & operator=(const server_context &) = delete;

    // queue a job; false when the queue is full
    bool submit(const std::shared_ptr<job> & j);

    // what each slot is doing now (GET /slots), and the requests waiting
    struct slot_view {
        int id;
        const char * state;  // "idle", "preparing" (a blend, an ingest), "running"
        const char * route;  // the request's route while it has one, else ""
    };
    std::vector<slot_view> slots() const;
    size_t queued() const;

  private:
    struct impl;
    std::unique_ptr<impl> d_;
};

}  // namespace kvblend
