// the page kvblend serve shows at / (off with --no-webui): add documents to the
// store, ask over some of them, and see the answer stream with what the fusion
// did (store hits, fused and recomputed tokens, the full prefill beside it).
// Served from the binary, no build step and nothing fetched from elsewhere;
// its API calls follow the server's key and origin rules like any client's.
#pragma once

#include <cstddef>
#include <string>

namespace kvblend {

struct web_asset {
    const char * path;  // "/", "/kvblend-ui.js", …
    const char * content_type;
    const char * body;
    size_t size;
};

// the asset served at path, or null
const web_asset * web_asset_for(const std::string & path);

// the Content-Security-Policy the assets are served with: scripts, styles and
// requests from this server only
const char * web_page_csp();

}  // namespace kvblend
