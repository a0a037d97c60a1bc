// kvblend CLI: the device flags, named as llama.cpp names them
// (--device, --rpc, -ngl, --list-devices).
#include <cstdio>
#include <cstdlib>

#include "cli/cli_util.h"

namespace kvblend::cli {

const char * k_device_help = R"(  -dev, --device DEV    where the weights, KV caches and compute live: cpu (or none),
                        cuda (a build with KVBLEND_CUDA), rpc:HOST:PORT (a ggml-rpc-server),
                        or a name from --list-devices (CUDA0, RPC0, …). default: the
                        first GPU when one is built in, else the CPU
  --rpc HOST:PORT[,…]   register ggml-rpc-servers (their devices become RPC0, RPC1, …);
                        without --device the model runs on the first of them
  -ngl, --n-gpu-layers N  layers on that device: all (default, also auto or any N >= the
                        layer count) or 0 (everything on the CPU); one device runs every
                        layer, so a split is refused
  --list-devices        print the devices this build can use and exit
  --mmap                map the model file instead of reading the weights into memory
                        (CPU only; repacked matrices are still copied, see --no-repack):
                        a model larger than the RAM pages in the weights it uses
  --no-repack           keep quantized matrices in the file's layout on the CPU (by default
                        q4_0, q4_K, iq4_nl, … are repacked at load for ggml's faster kernels,
                        as llama.cpp does; those round apart by batch size)
)";

bool match_device_flag(args & a, model_params & mp) {
    if (a.match({"-dev", "--device"})) {
        mp.device = a.str();
        if (mp.device.empty()) throw error("--device expects a device name (see --list-devices)");
    } else if (a.match({"--rpc"})) {
        bool first = true;
        for (const std::string & e : a.names()) {
            ggml_backend_dev_t dev = backend_add_rpc_server(e);
            if (first && mp.device.empty()) mp.device = ggml_backend_dev_name(dev);
            first = false;
        }
    } else if (a.match({"-ngl", "--n-gpu-layers", "--gpu-layers"})) {
        if (!a.done() && (a.peek() == "all" || a.peek() == "auto")) {
            a.str();
            mp.n_gpu_layers = -1;
        } else {
            mp.n_gpu_layers = (int32_t) a.integer(0, 1 << 20);
        }
    } else if (a.match({"--mmap"})) {
        mp.use_mmap = true;
    } else if (a.match({"--no-repack"})) {
        mp.repack = false;
    } else if (a.match({"--list-devices"})) {
        for (const std::string & d : backend_device_list()) std::printf("%s\n", d.c_str());
        std::fflush(stdout);
        std::exit(0);
    } else {
        return false;
    }
    return true;
}

}  // namespace kvblend::cli
