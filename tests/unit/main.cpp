// Catch2 entry point shared by the unit tests.
#define CATCH_CONFIG_MAIN
#include <catch2/catch.hpp>
