# sanitizer and fuzzing builds of kvblend (docs/RELIABILITY.md).
#
# included right after the pinned llama.cpp is added: the flags below apply to
# every target defined after this point (ours), not to ggml and libllama, which
# stay uninstrumented to keep these builds a few minutes on a small machine.
# ASan still sees their heap through its malloc; it does not check their code.
#
#   KVBLEND_SANITIZE=ON  AddressSanitizer + UndefinedBehaviorSanitizer (gcc or clang)
#   KVBLEND_TSAN=ON      ThreadSanitizer, set up by cmake/tsan.cmake (ggml too)
#   KVBLEND_FUZZ=ON      the libFuzzer targets of fuzz/ (clang only), with ASan + UBSan
option(KVBLEND_SANITIZE "build our code with ASan and UBSan" OFF)
option(KVBLEND_FUZZ "build the libFuzzer targets in fuzz/ (needs clang)" OFF)
# an instrumented libkvblend cannot be loaded by the plain python3 or linked by
# the plain consumers of the install test: such builds skip those tests
set(KVBLEND_INSTRUMENTED OFF)
if (KVBLEND_SANITIZE OR KVBLEND_TSAN OR KVBLEND_FUZZ)
    set(KVBLEND_INSTRUMENTED ON)
endif()

if (KVBLEND_TSAN AND (KVBLEND_SANITIZE OR KVBLEND_FUZZ))
    message(FATAL_ERROR "KVBLEND_TSAN cannot be combined with KVBLEND_SANITIZE or KVBLEND_FUZZ")
endif()

if (KVBLEND_SANITIZE OR KVBLEND_FUZZ)
    set(KVBLEND_SANITIZE_FLAGS -fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer)
    if (KVBLEND_FUZZ)
        if (NOT CMAKE_CXX_COMPILER_ID MATCHES "Clang")
            message(FATAL_ERROR "KVBLEND_FUZZ needs clang (scripts/fuzz.sh configures it)")
        endif()
        # coverage for libFuzzer in our code; the fuzzer's main is linked by fuzz/ only
        list(APPEND KVBLEND_SANITIZE_FLAGS -fsanitize=fuzzer-no-link)
    endif()
    add_compile_options(${KVBLEND_SANITIZE_FLAGS} -g)
    add_link_options(-fsanitize=address,undefined)
endif()

# fuzz/ needs the library targets, which are defined further down the top
# CMakeLists.txt: include it at the end of that file. in a normal build it only
# registers the short fuzz runs with ctest (label fuzz, through scripts/fuzz.sh)
cmake_language(DEFER DIRECTORY ${CMAKE_SOURCE_DIR} CALL include ${CMAKE_SOURCE_DIR}/fuzz/CMakeLists.txt)
