// Test-runner entry point for Catch2 2.x and 3.x alike.
#if __has_include(<catch2/catch_all.hpp>)
#include <catch2/catch_all.hpp>
int main(int argc, char* argv[]) { return Catch::Session().run(argc, argv); }
#else
#define CATCH_CONFIG_MAIN
#include <catch2/catch.hpp>
#endif
