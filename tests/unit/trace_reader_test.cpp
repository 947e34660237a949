// Tests for the allocation-trace reader: every action, plain and gzip'd
// files, and each class of malformed input reported with file and line.
#include <zlib.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <stdexcept>
#include <string>
#include <vector>

#include "support/catch.hpp"
#include "support/temp_dir.hpp"
#include "trace_reader.hpp"

namespace {

using streamalloc::load_trace;
using streamalloc::trace_file_action;
using streamalloc::trace_error;
using streamalloc::trace_file_event;
using streamalloc::trace_reader;

namespace fs = std::filesystem;

using streamalloc::test::temp_dir;

const std::string k_header = "action,addr,size,stream\n";

// Every event a reader returns, then the error it ended with ("" if none).
struct read_outcome {
  std::vector<trace_file_event> events;
  std::string error;
  std::uint64_t error_line = 0;
};

read_outcome read_until_error(const std::string& path) {
  read_outcome outcome;
  try {
    trace_reader reader(path);
    trace_file_event event;
    while (reader.next(&event)) outcome.events.push_back(event);
  } catch (const trace_error& e) {
    outcome.error = e.what();
    outcome.error_line = e.line();
  }
  return outcome;
}

// Many lines of plausible events, so the compressed file spans several
// zlib input buffers and the reader's buffer is refilled.
std::string many_lines(int count) {
  std::string text = k_header;
  for (int i = 0; i < count; ++i) {
    const std::string addr = std::to_string(140000000000000ULL + 512ULL * static_cast<unsigned>(i));
    text += "alloc," + addr + "," + std::to_string(1000 + i * 7) + ",0\n";
    text += "free_completed," + addr + "," + std::to_string(1000 + i * 7) + ",0\n";
  }
  return text;
}

}  // namespace

TEST_CASE("trace_reader reads every action, plain and gzip'd", "[trace_reader]") {
  const std::string body =
      "segment_alloc,140139680497664,2097152,0\n"
      "alloc,140139680497664,37632,0\n"
      "free_requested,140139680497664,37632,94000000000\n"
      "free_completed,140139680497664,37632,0\n"
      "segment_free,140139680497664,2097152,0\n"
      "segment_map,18446744073709551615,18446744073709551615,18446744073709551615\n"
      "segment_unmap,0,0,0\n"
      "oom,1024,2048,0\n"
      "snapshot,0,0,0";  // the last line has no newline
  temp_dir dir;
  const std::string plain = dir.write("t.csv", k_header + body);
  const std::string gzipped = dir.write_gzip("t.csv.gz", k_header + body);

  for (const std::string& path : {plain, gzipped}) {
    INFO(path);
    const std::vector<trace_file_event> events = load_trace(path);
    REQUIRE(events.size() == 9);
    CHECK(events[0].action == trace_file_action::segment_alloc);
    CHECK(events[0].addr == 140139680497664ULL);
    CHECK(events[0].size == 2097152);
    CHECK(events[0].line == 2);
    CHECK(events[1].action == trace_file_action::alloc);
    CHECK(events[1].size == 37632);
    CHECK(events[2].action == trace_file_action::free_requested);
    CHECK(events[2].stream == 94000000000ULL);
    CHECK(events[3].action == trace_file_action::free_completed);
    CHECK(events[4].action == trace_file_action::segment_free);
    CHECK(events[5].action == trace_file_action::segment_map);
    CHECK(events[5].addr == UINT64_MAX);
    CHECK(events[5].size == UINT64_MAX);
    CHECK(events[5].stream == UINT64_MAX);
    CHECK(events[6].action == trace_file_action::segment_unmap);
    CHECK(events[7].action == trace_file_action::other);
    CHECK(events[7].addr == 0);  // not read: the replay does not interpret it
    CHECK(events[8].action == trace_file_action::other);
    CHECK(events[8].line == 10);
  }
}

TEST_CASE("trace_reader streams events one at a time", "[trace_reader]") {
  temp_dir dir;
  const std::string path = dir.write_gzip("many.csv.gz", many_lines(20000));
  trace_reader reader(path);
  CHECK(reader.path() == path);
  trace_file_event event;
  std::uint64_t count = 0;
  std::uint64_t size_sum = 0;
  std::uint64_t lines_out_of_place = 0;
  while (reader.next(&event)) {
    ++count;
    if (event.line != count + 1) ++lines_out_of_place;
    size_sum += event.size;
  }
  CHECK(count == 40000);
  CHECK(lines_out_of_place == 0);
  // sizes 1000 + 7i, each twice
  CHECK(size_sum == 2 * (20000ULL * 1000 + 7ULL * (19999ULL * 20000 / 2)));
  CHECK(!reader.next(&event));
}

TEST_CASE("trace_reader accepts CRLF line ends and a missing final newline", "[trace_reader]") {
  temp_dir dir;
  const std::string path = dir.write("crlf.csv", "action,addr,size,stream\r\nalloc,1,2,3\r\nfree_completed,1,2,3");
  const std::vector<trace_file_event> events = load_trace(path);
  REQUIRE(events.size() == 2);
  CHECK(events[0].stream == 3);
  CHECK(events[1].action == trace_file_action::free_completed);
  CHECK(events[1].stream == 3);
}

TEST_CASE("trace_reader names the file and line of each malformed line", "[trace_reader]") {
  struct bad_line {
    std::string text;
    std::string reason;
  };
  const std::vector<bad_line> cases = {
      {"alloc,1,2", "expected 4 columns (action,addr,size,stream), found 3"},
      {"alloc,1,2,0,5", "expected 4 columns (action,addr,size,stream), found 5"},
      {"alloc", "expected 4 columns (action,addr,size,stream), found 1"},
      {"", "empty line"},
      {",1,2,0", "empty action field"},
      {"alloc,,2,0", "empty addr field"},
      {"alloc,1,,0", "empty size field"},
      {"alloc,1,2,", "empty stream field"},
      {"alloc,1x,2,0", "addr '1x' is not an unsigned whole number"},
      {"alloc,1,-2,0", "size '-2' is not an unsigned whole number"},
      {"alloc,1,+2,0", "size '+2' is not an unsigned whole number"},
      {"alloc, 1,2,0", "addr ' 1' is not an unsigned whole number"},
      {"alloc,1,2.5,0", "size '2.5' is not an unsigned whole number"},
      {"alloc,1,2.,0", "size '2.' is not an unsigned whole number"},
      {"alloc,1,2.0x,0", "size '2.0x' is not an unsigned whole number"},
      {"alloc,1,2e3,0", "size '2e3' is not an unsigned whole number"},
      {"alloc,1,2,0x", "stream '0x' is not an unsigned whole number"},
      {"alloc,0x1g,2,0", "addr '0x1g' is not an unsigned whole number"},
      {"alloc,0x10.0,2,0", "addr '0x10.0' is not an unsigned whole number"},
      {"alloc,0x-1,2,0", "addr '0x-1' is not an unsigned whole number"},
      {"alloc,0x10000000000000000,2,0", "addr '0x10000000000000000' is out of range"},
      {"alloc,18446744073709551616,2,0", "addr '18446744073709551616' is out of range"},
      {"alloc,1,99999999999999999999999,0", "size '99999999999999999999999' is out of range"},
      {"alloc,\"1,2,0", "a quoted field without its closing quote"},
      {"alloc,\"1\"x,2,0", "a quoted field without its closing quote, or text after it"},
      {"segment_resize,1,2", "expected 4 columns (action,addr,size,stream), found 3"},
  };
  temp_dir dir;
  int index = 0;
  for (const bad_line& bad : cases) {
    const std::string content = k_header + "alloc,7,512,0\n" + bad.text + "\nfree_completed,7,512,0\n";
    const std::string name = "bad" + std::to_string(index++);
    for (const std::string& path : {dir.write(name + ".csv", content), dir.write_gzip(name + ".csv.gz", content)}) {
      INFO("line: '" << bad.text << "' in " << path);
      const read_outcome outcome = read_until_error(path);
      CAPTURE(outcome.error);
      CHECK(outcome.events.size() == 1);  // the good line before the bad one
      CHECK(outcome.error_line == 3);
      CHECK(outcome.error.rfind(path + ":3: ", 0) == 0);
      CHECK(outcome.error.find(bad.reason) != std::string::npos);
    }
  }
}

TEST_CASE("trace_reader rejects a missing or wrong header on line 1", "[trace_reader]") {
  temp_dir dir;
  struct bad_header {
    std::string content;
    std::string reason;
  };
  const std::vector<bad_header> cases = {
      {"", "empty trace: expected header 'action,addr,size,stream'"},
      {"alloc,1,2,0\n", "expected header 'action,addr,size,stream' (those columns in any order; others are "
                         "ignored), found 'alloc,1,2,0', which lacks 'action', 'addr', 'size', 'stream'"},
      {"action,addr,size\nalloc,1,2\n", "found 'action,addr,size', which lacks 'stream'"},
      {"stream,size,addr,time_us\n", "found 'stream,size,addr,time_us', which lacks 'action'"},
      {"action,addr,size,stream,addr\n", "the header 'action,addr,size,stream,addr' names column 'addr' twice"},
      {"action,\"addr,size,stream\n", "which lacks 'action', 'addr', 'size', 'stream'"},
  };
  int index = 0;
  for (const bad_header& bad : cases) {
    const std::string name = "header" + std::to_string(index++);
    for (const std::string& path : {dir.write(name + ".csv", bad.content), dir.write_gzip(name + ".gz", bad.content)}) {
      INFO(path);
      try {
        trace_reader reader(path);
        FAIL("no error for header case '" << bad.content << "'");
      } catch (const trace_error& e) {
        CHECK(e.line() == 1);
        CHECK(e.path() == path);
        CHECK(std::string(e.what()).rfind(path + ":1: ", 0) == 0);
        CHECK(e.reason().find(bad.reason) != std::string::npos);
      }
    }
  }
}

TEST_CASE("trace_reader reports a file that cannot be opened", "[trace_reader]") {
  temp_dir dir;
  const std::string path = dir.write("exists.csv", k_header) + ".missing";
  try {
    load_trace(path);
    FAIL("no error for a missing file");
  } catch (const trace_error& e) {
    CHECK(e.line() == 0);
    CHECK(std::string(e.what()) == path + ": cannot open: No such file or directory");
  }
}

TEST_CASE("trace_reader reports a truncated gzip stream at the line where it ends", "[trace_reader]") {
  temp_dir dir;
  const std::string whole = dir.write_gzip("whole.csv.gz", many_lines(20000));
  const std::string bytes = dir.read_bytes(whole);
  REQUIRE(bytes.size() > 1000);

  SECTION("cut in the middle of the deflate data") {
    const std::string cut = dir.write("cut.csv.gz", bytes.substr(0, bytes.size() / 2));
    const read_outcome outcome = read_until_error(cut);
    CAPTURE(outcome.error);
    CHECK(outcome.events.size() > 1000);
    CHECK(outcome.events.size() < 40000);
    // Every complete line before the cut was returned; the cut line is next.
    CHECK(outcome.error_line == outcome.events.size() + 2);
    CHECK(outcome.error.rfind(cut + ":" + std::to_string(outcome.error_line) + ": truncated gzip stream", 0) == 0);
  }
  SECTION("only the gzip trailer missing") {
    const std::string cut = dir.write("no_trailer.csv.gz", bytes.substr(0, bytes.size() - 8));
    const read_outcome outcome = read_until_error(cut);
    CAPTURE(outcome.error);
    CHECK(outcome.events.size() == 40000);
    CHECK(outcome.error_line == 40002);
    CHECK(outcome.error.find("truncated gzip stream") != std::string::npos);
  }
  SECTION("a damaged checksum") {
    std::string damaged = bytes;
    damaged[damaged.size() - 8] = static_cast<char>(damaged[damaged.size() - 8] ^ 0x5a);
    const read_outcome outcome = read_until_error(dir.write("bad_crc.csv.gz", damaged));
    CAPTURE(outcome.error);
    CHECK(outcome.error.find("corrupt gzip stream") != std::string::npos);
  }
}

TEST_CASE("trace_reader takes the columns in the header's order and ignores others", "[trace_reader]") {
  temp_dir dir;
  const std::string body =
      "Stream, SIZE ,time_us,addr,frames,action\n"
      "7,512,100,4096,\"model.py:10, in forward\",alloc\n"
      "0,2097152,101,8192,,segment_alloc\n"
      "7,512,102,4096,\"a \"\"quoted\"\" frame, and a comma\",free_completed\r\n"
      "7,512,103,4096,\"\",free_requested";
  for (const std::string& path : {dir.write("cols.csv", body), dir.write_gzip("cols.csv.gz", body)}) {
    INFO(path);
    const std::vector<trace_file_event> events = load_trace(path);
    REQUIRE(events.size() == 4);
    CHECK(events[0].action == trace_file_action::alloc);
    CHECK(events[0].addr == 4096);
    CHECK(events[0].size == 512);
    CHECK(events[0].stream == 7);
    CHECK(events[1].action == trace_file_action::segment_alloc);
    CHECK(events[1].size == 2097152);
    CHECK(events[1].stream == 0);
    CHECK(events[2].action == trace_file_action::free_completed);
    CHECK(events[2].addr == 4096);
    CHECK(events[3].action == trace_file_action::free_requested);
    CHECK(events[3].line == 5);
  }
  SECTION("every line has as many columns as the header") {
    const std::string path = dir.write("short.csv", "action,addr,size,stream,time_us\nalloc,1,2,0,5\nalloc,3,4,0\n");
    const read_outcome outcome = read_until_error(path);
    CHECK(outcome.events.size() == 1);
    CHECK(outcome.error_line == 3);
    CHECK(outcome.error.find("expected 5 columns (action,addr,size,stream,time_us), found 4") != std::string::npos);
  }
}

TEST_CASE("trace_reader reads a header after a UTF-8 byte order mark", "[trace_reader]") {
  temp_dir dir;
  const std::string path = dir.write("bom.csv", "\xEF\xBB\xBF" + k_header + "alloc,1,2,0\n");
  const std::vector<trace_file_event> events = load_trace(path);
  REQUIRE(events.size() == 1);
  CHECK(events[0].action == trace_file_action::alloc);
}

TEST_CASE("trace_reader reads whole numbers written as floats", "[trace_reader]") {
  // pandas writes an integer column that also holds an empty cell as floats.
  temp_dir dir;
  const std::string path = dir.write("floats.csv", k_header + "alloc,140139680497664.0,37632.0,0.0\n"
                                                              "free_completed,140139680497664.00,37632,0\n");
  const std::vector<trace_file_event> events = load_trace(path);
  REQUIRE(events.size() == 2);
  CHECK(events[0].addr == 140139680497664ULL);
  CHECK(events[0].size == 37632);
  CHECK(events[0].stream == 0);
  CHECK(events[1].addr == 140139680497664ULL);
}

TEST_CASE("trace_reader reads hexadecimal numbers after 0x", "[trace_reader]") {
  // Pointers and stream handles are often printed in hexadecimal.
  temp_dir dir;
  const std::string path = dir.write("hex.csv", k_header + "alloc,0x7F7500000000,0x200,0x55aa01\n"
                                                           "free_completed,0x7f7500000000,512,5614081\n");
  const std::vector<trace_file_event> events = load_trace(path);
  REQUIRE(events.size() == 2);
  CHECK(events[0].addr == 0x7f7500000000ULL);
  CHECK(events[0].size == 512);
  CHECK(events[0].stream == 0x55aa01);
  CHECK(events[1].addr == events[0].addr);
  CHECK(events[1].stream == events[0].stream);
}

TEST_CASE("trace_reader skips and tallies lines of actions the format does not name", "[trace_reader]") {
  temp_dir dir;
  const std::string path = dir.write("unknown.csv", k_header +
                                                        "alloc,7,512,0\n"
                                                        "segment_resize,not,a number,0\n"
                                                        "Alloc,1,2,0\n"
                                                        "segment_resize,1,2,0\n"
                                                        "free_completed,7,512,0\n");
  trace_reader reader(path);
  std::vector<trace_file_event> events;
  trace_file_event event;
  while (reader.next(&event)) events.push_back(event);
  REQUIRE(events.size() == 5);
  CHECK(events[1].action == trace_file_action::other);
  CHECK(events[1].line == 3);
  CHECK(events[2].action == trace_file_action::other);
  CHECK(events[4].action == trace_file_action::free_completed);
  const std::vector<streamalloc::skipped_action>& skipped = reader.skipped_actions();
  REQUIRE(skipped.size() == 2);
  CHECK(skipped[0].name == "segment_resize");
  CHECK(skipped[0].lines == 2);
  CHECK(skipped[0].first_line == 3);
  CHECK(skipped[1].name == "Alloc");
  CHECK(skipped[1].lines == 1);
  CHECK(skipped[1].first_line == 4);

  SECTION("oom and snapshot are known: read, not skipped, their numbers not checked") {
    std::vector<streamalloc::skipped_action> none;
    const std::vector<trace_file_event> known =
        load_trace(dir.write("known.csv", k_header + "oom,1,2,0\nsnapshot,0,0,0\noom,,123456,\n"), &none);
    CHECK(known.size() == 3);
    CHECK(known[2].action == trace_file_action::other);
    CHECK(none.empty());
  }
  SECTION("past the name limit, names share one entry") {
    std::string body = k_header;
    const std::size_t names = trace_reader::k_max_skipped_names + 4;
    for (std::size_t i = 0; i < names; ++i) body += "made_up_" + std::to_string(i) + ",1,2,0\n";
    std::vector<streamalloc::skipped_action> many;
    load_trace(dir.write("many.csv", body), &many);
    REQUIRE(many.size() == trace_reader::k_max_skipped_names);
    CHECK(many.back().name == "(other names)");
    std::uint64_t lines = 0;
    for (const streamalloc::skipped_action& a : many) lines += a.lines;
    CHECK(lines == names);
    CHECK(many.back().lines == names - (trace_reader::k_max_skipped_names - 1));
  }
}

TEST_CASE("trace_file_action names match the trace format", "[trace_reader]") {
  CHECK(std::string(streamalloc::to_string(trace_file_action::alloc)) == "alloc");
  CHECK(std::string(streamalloc::to_string(trace_file_action::free_requested)) == "free_requested");
  CHECK(std::string(streamalloc::to_string(trace_file_action::free_completed)) == "free_completed");
  CHECK(std::string(streamalloc::to_string(trace_file_action::segment_alloc)) == "segment_alloc");
  CHECK(std::string(streamalloc::to_string(trace_file_action::segment_free)) == "segment_free");
  CHECK(std::string(streamalloc::to_string(trace_file_action::segment_map)) == "segment_map");
  CHECK(std::string(streamalloc::to_string(trace_file_action::segment_unmap)) == "segment_unmap");
  CHECK(std::string(streamalloc::to_string(trace_file_action::other)) == "other");
}
