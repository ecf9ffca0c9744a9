# Builds tests/unit into one Catch2 binary linked against libdualkv.so.
file(GLOB DUALKV_UNIT_SOURCES ${PROJECT_SOURCE_DIR}/tests/unit/*.cpp)
add_executable(dualkv-unit-tests ${DUALKV_UNIT_SOURCES})
target_compile_options(dualkv-unit-tests PRIVATE ${DUALKV_WARNINGS})
target_include_directories(dualkv-unit-tests PRIVATE ${PROJECT_SOURCE_DIR}/runtime/lib)
target_link_libraries(dualkv-unit-tests PRIVATE dualkv Catch2::Catch2 fmt::fmt-header-only
                      nlohmann_json::nlohmann_json)
include(Catch)
# --warn NoTests: an entry whose filter matches no test case fails instead of
# passing empty (a test name with ';' is cut there by ctest and used to run
# nothing).
catch_discover_tests(dualkv-unit-tests TEST_PREFIX "unit: " EXTRA_ARGS --warn NoTests
                     PROPERTIES LABELS "cpu;unit")
