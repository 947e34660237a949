// Includes Catch2 whichever major version is installed (Debian 12 ships
// 2.13, newer systems 3.x), so tests build with both.
#pragma once

#if __has_include(<catch2/catch_all.hpp>)
#include <catch2/catch_all.hpp>
#else
#include <catch2/catch.hpp>
#endif
