# run by `cmake --install`: puts the Python package where the prefix's Python
# looks. the interpreters asked, in order: PREFIX/bin/python3 (a venv, a
# pyenv version), python3 on PATH, /usr/bin/python3; the first whose site
# directories include one under the prefix names it (Debian's python3 reads
# /usr/local/lib/python3.X/dist-packages for the prefix /usr/local). none:
# LIBDIR/python3/dist-packages, to add to PYTHONPATH. KVBLEND_PYTHON_DIR, when
# set at configure time, wins.
set(prefix "${CMAKE_INSTALL_PREFIX}")
set(dir "${KVBLEND_PYTHON_DIR}")
if (NOT dir)
    find_program(path_python3 python3)
    foreach (py "${prefix}/bin/python3" "${path_python3}" /usr/bin/python3)
        if (dir OR NOT EXISTS "${py}")
            continue()
        endif()
        execute_process(COMMAND "${py}" -c
            "import site, sys, os\np = os.path.realpath(sys.argv[1])\nfor d in site.getsitepackages():\n    if os.path.realpath(d).startswith(p + os.sep):\n        print(d)\n        break"
            "${prefix}" OUTPUT_VARIABLE dir OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
    endforeach()
endif()
if (NOT dir)
    set(dir "${prefix}/${KVBLEND_INSTALL_LIBDIR}/python3/dist-packages")
    message(STATUS "kvblend: no Python of ${prefix} looks for packages there; the binding goes to ${dir} (add it to PYTHONPATH)")
endif()
file(INSTALL "${KVBLEND_PYTHON_SOURCE}" DESTINATION "${dir}" PATTERN __pycache__ EXCLUDE)
