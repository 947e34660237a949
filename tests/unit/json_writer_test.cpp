// Tests for json_writer (streamalloc/util/json_writer.hpp), the JSON emitter
// of streamalloc-replay and streamalloc-bench: string escaping, nesting,
// separators, numbers and misuse.
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>

#include "streamalloc/util/json_writer.hpp"
#include "support/catch.hpp"

using streamalloc::json_string;
using streamalloc::json_writer;

TEST_CASE("json_string escapes quotes, backslashes and control characters", "[json_writer]") {
  CHECK(json_string("") == "\"\"");
  CHECK(json_string("plain text") == "\"plain text\"");
  CHECK(json_string("say \"hi\"") == "\"say \\\"hi\\\"\"");
  CHECK(json_string("C:\\dir\\file") == "\"C:\\\\dir\\\\file\"");
  CHECK(json_string("a\nb\rc\td") == "\"a\\nb\\rc\\td\"");
  CHECK(json_string("\b\f") == "\"\\b\\f\"");
  CHECK(json_string(std::string("nul\0byte", 8)) == "\"nul\\u0000byte\"");
  CHECK(json_string("\x01\x1f") == "\"\\u0001\\u001f\"");
  // UTF-8 passes through as bytes; 0x7f is not a control character in JSON.
  CHECK(json_string("r\xc3\xa9sum\xc3\xa9 \x7f") == "\"r\xc3\xa9sum\xc3\xa9 \x7f\"");
  // '/' may be escaped in JSON but need not be.
  CHECK(json_string("a/b") == "\"a/b\"");
}

TEST_CASE("json_writer nests objects and arrays with separators", "[json_writer]") {
  json_writer w;
  w.begin_object();
  w.key("name").value("trace \"a\"").key("count").value(3).key("big").value(18446744073709551615ULL);
  w.key("negative").value(-7LL).key("flag").value(true).key("off").value(false).key("none").null();
  w.key("list").begin_array().value(1).value("two").begin_object().end_object().begin_array().end_array().end_array();
  w.key("empty").begin_object().end_object();
  w.end_object();
  CHECK(w.complete());
  CHECK(w.str() ==
        "{\"name\": \"trace \\\"a\\\"\", \"count\": 3, \"big\": 18446744073709551615, \"negative\": -7, "
        "\"flag\": true, \"off\": false, \"none\": null, \"list\": [1, \"two\", {}, []], \"empty\": {}}");
}

TEST_CASE("json_writer writes fixed-point numbers and null for non-finite ones", "[json_writer]") {
  json_writer w;
  w.begin_array();
  w.value(1.2861723, 6).value(0.5, 2).value(2.0, 0).value(1.0);
  w.value(std::numeric_limits<double>::quiet_NaN(), 3).value(std::numeric_limits<double>::infinity(), 3);
  w.value(-std::numeric_limits<double>::infinity());
  w.end_array();
  CHECK(w.str() == "[1.286172, 0.50, 2, 1.000000, null, null, null]");
}

TEST_CASE("json_writer puts members on new lines when asked", "[json_writer]") {
  json_writer w;
  w.begin_object().key("a").value(1);
  w.newline().key("items").begin_array();
  w.newline().value(1);
  w.newline().value(2);
  w.newline().end_array();
  w.end_object();
  CHECK(w.str() == "{\"a\": 1,\n  \"items\": [\n    1,\n    2\n  ]}");
}

TEST_CASE("json_writer keys are escaped like values", "[json_writer]") {
  json_writer w;
  w.begin_object().key("we\"ird\n").value("x").end_object();
  CHECK(w.str() == "{\"we\\\"ird\\n\": \"x\"}");
}

TEST_CASE("json_writer rejects misuse", "[json_writer]") {
  SECTION("a value in an object without a key") {
    json_writer w;
    w.begin_object();
    CHECK_THROWS_AS(w.value(1), std::logic_error);
  }
  SECTION("a key outside an object") {
    json_writer w;
    w.begin_array();
    CHECK_THROWS_AS(w.key("k"), std::logic_error);
  }
  SECTION("two keys in a row") {
    json_writer w;
    w.begin_object().key("a");
    CHECK_THROWS_AS(w.key("b"), std::logic_error);
  }
  SECTION("closing what is not open") {
    json_writer w;
    CHECK_THROWS_AS(w.end_object(), std::logic_error);
    json_writer array;
    array.begin_array();
    CHECK_THROWS_AS(array.end_object(), std::logic_error);
  }
  SECTION("closing an object after a key with no value") {
    json_writer w;
    w.begin_object().key("a");
    CHECK_THROWS_AS(w.end_object(), std::logic_error);
  }
  SECTION("a second document") {
    json_writer w;
    w.value(1);
    CHECK(w.complete());
    CHECK_THROWS_AS(w.value(2), std::logic_error);
  }
  SECTION("an unfinished document is not complete") {
    json_writer w;
    CHECK_FALSE(w.complete());
    w.begin_object();
    CHECK_FALSE(w.complete());
  }
}
