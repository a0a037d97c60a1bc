# the ThreadSanitizer build (docs/RELIABILITY.md), included before the pinned
# llama.cpp is added: unlike ASan, it must see every thread's memory accesses
# and synchronization, so ggml and libllama are instrumented too, and ggml runs
# its own thread pool (C11 atomics, which TSan understands) instead of OpenMP
# (libgomp is not instrumented: its barriers would look like races)
option(KVBLEND_TSAN "build kvblend, ggml and libllama with ThreadSanitizer" OFF)
if (KVBLEND_TSAN)
    set(GGML_OPENMP OFF CACHE BOOL "" FORCE)
    add_compile_options(-fsanitize=thread -fno-omit-frame-pointer -g)
    add_link_options(-fsanitize=thread)
endif()
