# how ggml and libllama are compiled: the one place for their options, shared
# by kvblend's build and bench/peer (llama-server on the same ggml)
option(KVBLEND_CUDA   "build ggml's CUDA backend" OFF)
option(KVBLEND_NO_AMX "build ggml without AMX kernels" ON)

set(BUILD_SHARED_LIBS     OFF CACHE BOOL "" FORCE)
# libkvblend.so links ggml and libllama in: every object must be position independent
set(CMAKE_POSITION_INDEPENDENT_CODE ON)
set(GGML_CUDA ${KVBLEND_CUDA} CACHE BOOL "" FORCE)
# the CUDA build: one architecture (CMAKE_CUDA_ARCHITECTURES, set by
# scripts/setup.sh from KVBLEND_CUDA_ARCH), flash attention for f16/q8_0/q4_0 only
set(GGML_CUDA_FA_ALL_QUANTS OFF CACHE BOOL "" FORCE)
# one device runs every layer (a split is refused): no NCCL, whose library the
# GPU machine may lack
set(GGML_CUDA_NCCL OFF CACHE BOOL "" FORCE)
# a build machine with the toolkit and no GPU has no driver library
# (libcuda.so.1): ggml-cuda then links the toolkit's stub, and the programs that
# link libkvblend.so resolve libcuda.so.1 through the same stub, at link time
# only (at run time the GPU's driver provides it)
if (KVBLEND_CUDA)
    find_package(CUDAToolkit REQUIRED)
    find_library(KVBLEND_CUDA_DRIVER NAMES libcuda.so.1 PATHS ${CUDAToolkit_LIBRARY_DIR} NO_CACHE)
    if (NOT KVBLEND_CUDA_DRIVER AND EXISTS "${CUDAToolkit_LIBRARY_DIR}/stubs/libcuda.so")
        set(stub_dir ${CMAKE_BINARY_DIR}/cuda-stub)
        file(MAKE_DIRECTORY ${stub_dir})
        file(CREATE_LINK "${CUDAToolkit_LIBRARY_DIR}/stubs/libcuda.so" ${stub_dir}/libcuda.so.1 SYMBOLIC)
        add_link_options(-Wl,-rpath-link,${stub_dir})
        # nothing built can start here: list the gtest cases when ctest runs
        # (on the GPU machine), not right after linking
        set(CMAKE_GTEST_DISCOVER_TESTS_DISCOVERY_MODE PRE_TEST)
    endif()
endif()
# ggml's RPC backend (a device in another process, over TCP): small, and what
# the rpc tests run the model on to catch any host-pointer shortcut (--device rpc:HOST:PORT)
set(GGML_RPC      ON  CACHE BOOL "" FORCE)
set(GGML_RPC_RDMA OFF CACHE BOOL "" FORCE)
# AMX tiles fault (SIGILL) on hosts that advertise AMX but whose hypervisor
# does not enable its state, as on our CI machines: keep ggml off those kernels
if (KVBLEND_NO_AMX AND CMAKE_SYSTEM_PROCESSOR MATCHES "x86_64|AMD64")
    include(CheckCXXCompilerFlag)
    check_cxx_compiler_flag(-mno-amx-tile KVBLEND_HAVE_MNO_AMX)
    if (KVBLEND_HAVE_MNO_AMX)
        add_compile_options(-mno-amx-tile -mno-amx-int8 -mno-amx-bf16)
    endif()
endif()
