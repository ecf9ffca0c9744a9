# Builds tests/unit (one folder per runtime layer) into one Catch2 binary. The
# tests reach below the public API (the fake driver, the disk cache, work
# items, llvm::Error results), so they link dualkv_static: libdualkv.so
# exports the public API alone.
file(GLOB_RECURSE DUALKV_UNIT_SOURCES CONFIGURE_DEPENDS
     ${PROJECT_SOURCE_DIR}/tests/unit/*.cpp)
add_executable(dualkv-unit-tests ${DUALKV_UNIT_SOURCES})
target_compile_options(dualkv-unit-tests PRIVATE ${DUALKV_WARNINGS})
target_include_directories(dualkv-unit-tests PRIVATE ${PROJECT_SOURCE_DIR}/tests/unit)
target_link_libraries(dualkv-unit-tests PRIVATE dualkv_static Catch2::Catch2
                      fmt::fmt-header-only nlohmann_json::nlohmann_json)
include(Catch)
# --warn NoTests: an entry whose filter matches no test case fails instead of
# passing empty (a test name with ';' is cut there by ctest and used to run
# nothing). Catch's discovery flattens a list of labels (LABELS cpu unit made
# "unit" a property name), so the label `unit` is the folder's.
catch_discover_tests(dualkv-unit-tests TEST_PREFIX "unit: " EXTRA_ARGS --warn NoTests
                     PROPERTIES LABELS cpu)
set_property(DIRECTORY PROPERTY LABELS unit)
