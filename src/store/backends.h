// store backends behind store_open (include/kvblend/store.h).
#pragma once

#include <memory>
#include <string>

#include "kvblend/store.h"

namespace kvblend {

// the embedded default: one file per entry plus an index, in a directory
std::unique_ptr<store> dir_store_open(const std::string & path, const store_options & opts);

// redis://[[USER]:PASSWORD@]HOST[:PORT][/DB][?timeout=S] (HOST may be [IPv6]), through
// hiredis; entries live under "kvblend:chunk:<key>". uri() hides the password.
// redis-cluster://[[USER]:PASSWORD@]HOST[:PORT][,HOST[:PORT]…][?timeout=S] (or a
// redis:// URI naming a cluster's node): entries under "kvblend:chunk:{<key>}"
std::unique_ptr<store> redis_store_open(const std::string & uri, const store_options & opts);

// the cluster slot of a chunk key's entry (CRC16 of the key, its hash tag)
int redis_cluster_slot(const std::string & key);

}  // namespace kvblend
