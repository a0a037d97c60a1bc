// rag_fuse (kvblend/rag.h) in steps, for the serving loop: the chunks are
// fetched (or collected) and placed when it starts, on the engine that holds
// the cache; the blend's pieces are then run by the caller, beside other
// sequences (blend_steps), and finish() gives what rag_fuse gives.
#pragma once

#include <functional>
#include <memory>
#include <vector>

#include "blend/blend_steps.h"
#include "kvblend/rag.h"

namespace kvblend {

class rag_fuse_steps {
  public:
    rag_fuse_steps(engine & eng, const rag_prompt & rp, const rag_fuse_params & p,
                   const std::function<ggml_tensor *(int64_t)> & hidden_for,
                   const std::vector<const chunk_kv *> & given = {});
    blend_steps & blend() { return *steps_; }
    // the engine's meter when the placement began
    const energy_mark & blend_mark() const { return blend_mark_; }
    // once the blend is done: its result (no eviction: the caller's cache has
    // no policy; the blend's energy is not its own beside other sequences)
    rag_fuse_result finish();

  private:
    std::vector<chunk_ptr> fetched_;  // held until the blend is done, whatever the tiers drop meanwhile
    rag_fuse_result r_;
    energy_mark blend_mark_;
    std::unique_ptr<blend_steps> steps_;
};

}  // namespace kvblend
