# kvblend: the installable artefacts and `cmake --install build --prefix P`:
# libkvblend.so (C API only), libkvblend.a (the C API with ggml and libllama
# inside), include/kvblend.h, the kvblend CLI, the CMake package
# (find_package(kvblend)), the pkg-config file and the Python binding.
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

# libkvblend.a: our objects and the static ggml and libllama archives merged
# into one, so that a user links one library (GNU ar's MRI script)
set(KVBLEND_BUNDLED_TARGETS kvblend_lib llama ggml ggml-base ggml-cpu)
foreach (t ggml-cuda ggml-blas ggml-rpc)
    if (TARGET ${t})
        list(APPEND KVBLEND_BUNDLED_TARGETS ${t})
    endif()
endforeach()
set(KVBLEND_STATIC_ARCHIVE ${CMAKE_BINARY_DIR}/lib/libkvblend.a)
set(_mri "create ${KVBLEND_STATIC_ARCHIVE}\n")
foreach (t ${KVBLEND_BUNDLED_TARGETS})
    string(APPEND _mri "addlib $<TARGET_FILE:${t}>\n")
endforeach()
string(APPEND _mri "save\nend\n")
file(GENERATE OUTPUT ${CMAKE_BINARY_DIR}/kvblend_static.mri CONTENT "${_mri}")
add_custom_command(OUTPUT ${KVBLEND_STATIC_ARCHIVE}
    COMMAND ${CMAKE_COMMAND} -E make_directory ${CMAKE_BINARY_DIR}/lib
    COMMAND ${CMAKE_COMMAND} -E rm -f ${KVBLEND_STATIC_ARCHIVE}
    COMMAND ${CMAKE_AR} -M < ${CMAKE_BINARY_DIR}/kvblend_static.mri
    COMMAND ${CMAKE_RANLIB} ${KVBLEND_STATIC_ARCHIVE}
    DEPENDS ${KVBLEND_BUNDLED_TARGETS} ${CMAKE_BINARY_DIR}/kvblend_static.mri
    COMMENT "merging libkvblend.a")
add_custom_target(kvblend_static ALL DEPENDS ${KVBLEND_STATIC_ARCHIVE})

# what a program linking libkvblend.a needs besides it (C programs need the
# C++ runtime too)
set(KVBLEND_STATIC_DEPS hiredis)
if (GGML_OPENMP_ENABLED)
    find_package(OpenMP COMPONENTS C)
    if (OpenMP_C_FOUND)
        list(APPEND KVBLEND_STATIC_DEPS ${OpenMP_C_LIB_NAMES})
    endif()
endif()
if (KVBLEND_CUDA)
    list(APPEND KVBLEND_STATIC_DEPS cudart cublas cublasLt cuda)
endif()
list(APPEND KVBLEND_STATIC_DEPS pthread dl m stdc++)
list(REMOVE_DUPLICATES KVBLEND_STATIC_DEPS)
set(KVBLEND_PC_LIBS_PRIVATE "")
foreach (d ${KVBLEND_STATIC_DEPS})
    string(APPEND KVBLEND_PC_LIBS_PRIVATE " -l${d}")
endforeach()
string(STRIP "${KVBLEND_PC_LIBS_PRIVATE}" KVBLEND_PC_LIBS_PRIVATE)

install(TARGETS kvblend_shared LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR})
install(FILES ${KVBLEND_STATIC_ARCHIVE} DESTINATION ${CMAKE_INSTALL_LIBDIR})
install(FILES ${CMAKE_SOURCE_DIR}/include/kvblend.h DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(TARGETS kvblend RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})

# find_package(kvblend): kvblend::kvblend (shared) and kvblend::kvblend_static
set(KVBLEND_CMAKE_DIR ${CMAKE_INSTALL_LIBDIR}/cmake/kvblend)
configure_package_config_file(${CMAKE_SOURCE_DIR}/cmake/kvblendConfig.cmake.in
    ${CMAKE_BINARY_DIR}/kvblendConfig.cmake INSTALL_DESTINATION ${KVBLEND_CMAKE_DIR}
    PATH_VARS CMAKE_INSTALL_INCLUDEDIR CMAKE_INSTALL_LIBDIR)
# before 1.0 a minor version may change the ABI (the soname follows the major)
write_basic_package_version_file(${CMAKE_BINARY_DIR}/kvblendConfigVersion.cmake
    VERSION ${PROJECT_VERSION} COMPATIBILITY SameMinorVersion)
install(FILES ${CMAKE_BINARY_DIR}/kvblendConfig.cmake ${CMAKE_BINARY_DIR}/kvblendConfigVersion.cmake
        DESTINATION ${KVBLEND_CMAKE_DIR})

# kvblend.pc, relocatable: the prefix is found from where the file lies
file(RELATIVE_PATH KVBLEND_PC_TO_PREFIX /p/${CMAKE_INSTALL_LIBDIR}/pkgconfig /p)
configure_file(${CMAKE_SOURCE_DIR}/cmake/kvblend.pc.in ${CMAKE_BINARY_DIR}/kvblend.pc @ONLY)
install(FILES ${CMAKE_BINARY_DIR}/kvblend.pc DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig)

# the Python binding (ctypes, standard library only): where the prefix's Python
# looks (cmake/install_python.cmake), from where it finds LIBDIR/libkvblend.so.N
set(KVBLEND_PYTHON_DIR "" CACHE PATH "where cmake --install puts the Python package (empty: where the prefix's python3 looks)")
install(CODE "set(KVBLEND_PYTHON_DIR \"${KVBLEND_PYTHON_DIR}\")
set(KVBLEND_INSTALL_LIBDIR \"${CMAKE_INSTALL_LIBDIR}\")
set(KVBLEND_PYTHON_SOURCE \"${CMAKE_SOURCE_DIR}/python/kvblend\")")
install(SCRIPT ${CMAKE_SOURCE_DIR}/cmake/install_python.cmake)
