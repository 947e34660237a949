// Allocation-trace reader: zlib's gz* API reads gzip and plain files alike
// (it checks the magic bytes), lines are cut out of a large buffer with
// memchr and parsed in place, so a 35k-line trace parses in milliseconds.
#include "trace_reader.hpp"

#include <zlib.h>

#include <cerrno>
#include <charconv>
#include <cstring>
#include <limits>

namespace streamalloc {
namespace {

constexpr std::string_view k_header = "action,addr,size,stream";
constexpr std::size_t k_buffer_bytes = 256 * 1024;  // also the longest line accepted
constexpr unsigned k_zlib_buffer_bytes = 128 * 1024;
constexpr std::size_t k_quoted_field_chars = 40;  // keeps messages readable on garbage input
constexpr int k_column_count = 4;
constexpr const char* k_column_names[k_column_count] = {"action", "addr", "size", "stream"};

std::string quoted(std::string_view text) {
  std::string out = "'";
  if (text.size() > k_quoted_field_chars) {
    out.append(text.substr(0, k_quoted_field_chars));
    out += "...";
  } else {
    out.append(text);
  }
  out += "'";
  return out;
}

// Every action torch's TraceEntry knows (c10/core/CachingDeviceAllocator.h,
// parseTraceEntryAction); oom and snapshot are read as trace_file_action::other.
struct action_name {
  std::string_view name;
  trace_file_action action;
};
constexpr action_name k_actions[] = {
    {"alloc", trace_file_action::alloc},
    {"free_requested", trace_file_action::free_requested},
    {"free_completed", trace_file_action::free_completed},
    {"segment_alloc", trace_file_action::segment_alloc},
    {"segment_free", trace_file_action::segment_free},
    {"segment_map", trace_file_action::segment_map},
    {"segment_unmap", trace_file_action::segment_unmap},
    {"oom", trace_file_action::other},
    {"snapshot", trace_file_action::other},
};

// False for a name outside k_actions: a trace from a newer torch, or not
// a trace at all; replaying it as if the line were not there could give
// wrong figures without a word.
bool parse_action(std::string_view name, trace_file_action* out) {
  for (const action_name& known : k_actions) {
    if (name == known.name) {
      *out = known.action;
      return true;
    }
  }
  return false;
}

std::string known_action_list() {
  std::string list;
  for (const action_name& known : k_actions) {
    if (!list.empty()) list += ", ";
    list.append(known.name);
  }
  return list;
}

// zlib prefixes its messages with the path it was opened with; the
// trace_error message already names the file.
std::string zlib_message(const std::string& path, const char* message) {
  std::string_view text = message ? message : "";
  const std::string prefix = path + ": ";
  if (text.substr(0, prefix.size()) == prefix) text.remove_prefix(prefix.size());
  return std::string(text);
}

std::string describe_stream_error(int errnum, const std::string& detail) {
  switch (errnum) {
    case Z_BUF_ERROR:
      return "truncated gzip stream (zlib: " + detail + ")";
    case Z_DATA_ERROR:
      return "corrupt gzip stream (zlib: " + detail + ")";
    case Z_ERRNO:
      return "read error: " + detail;
    default:
      return "zlib error " + std::to_string(errnum) + ": " + detail;
  }
}

}  // namespace

const char* to_string(trace_file_action action) {
  switch (action) {
    case trace_file_action::alloc: return "alloc";
    case trace_file_action::free_requested: return "free_requested";
    case trace_file_action::free_completed: return "free_completed";
    case trace_file_action::segment_alloc: return "segment_alloc";
    case trace_file_action::segment_free: return "segment_free";
    case trace_file_action::segment_map: return "segment_map";
    case trace_file_action::segment_unmap: return "segment_unmap";
    case trace_file_action::other: return "other";
  }
  return "other";
}

trace_error::trace_error(const std::string& path, std::uint64_t line, const std::string& reason)
    : std::runtime_error(line == 0 ? path + ": " + reason : path + ":" + std::to_string(line) + ": " + reason),
      path_(path),
      line_(line),
      reason_(reason) {}

void trace_reader::gz_closer::operator()(gzFile_s* file) const { gzclose(file); }

trace_reader::trace_reader(const std::string& path) : path_(path), buffer_(k_buffer_bytes) {
  errno = 0;
  file_.reset(gzopen(path.c_str(), "rb"));
  if (!file_) fail(0, std::string("cannot open: ") + (errno != 0 ? std::strerror(errno) : "zlib could not allocate"));
  gzbuffer(file_.get(), k_zlib_buffer_bytes);
  std::string_view header;
  if (!next_line(&header)) fail(1, "empty trace: expected header '" + std::string(k_header) + "'");
  if (header != k_header) fail(1, "expected header '" + std::string(k_header) + "', found " + quoted(header));
}

trace_reader::~trace_reader() = default;

void trace_reader::fail(std::uint64_t line, const std::string& reason) const { throw trace_error(path_, line, reason); }

void trace_reader::refill() {
  if (begin_ > 0) {
    std::memmove(buffer_.data(), buffer_.data() + begin_, end_ - begin_);
    end_ -= begin_;
    begin_ = 0;
  }
  if (end_ == buffer_.size()) fail(line_ + 1, "line longer than " + std::to_string(buffer_.size()) + " bytes");
  const int got = gzread(file_.get(), buffer_.data() + end_, static_cast<unsigned>(buffer_.size() - end_));
  if (got > 0) end_ += static_cast<std::size_t>(got);
  // A truncated stream is reported as Z_BUF_ERROR alongside the last data
  // zlib could decompress, not as a failed read: check after every read.
  int errnum = Z_OK;
  const char* message = gzerror(file_.get(), &errnum);
  if (got < 0 || errnum != Z_OK) {
    stream_error_ = describe_stream_error(errnum, zlib_message(path_, message));
    at_eof_ = true;
  } else if (got == 0) {
    at_eof_ = true;
  }
}

bool trace_reader::next_line(std::string_view* line) {
  for (;;) {
    const char* start = buffer_.data() + begin_;
    const std::size_t available = end_ - begin_;
    const auto* newline = static_cast<const char*>(std::memchr(start, '\n', available));
    std::size_t length = 0;
    if (newline != nullptr) {
      length = static_cast<std::size_t>(newline - start);
      begin_ += length + 1;
    } else if (at_eof_) {
      // An unterminated last line of a damaged stream may be cut anywhere
      // (even inside a number), so it is never parsed.
      if (!stream_error_.empty()) fail(line_ + 1, stream_error_);
      if (available == 0) return false;
      length = available;
      begin_ = end_;
    } else {
      refill();
      continue;
    }
    ++line_;
    if (length > 0 && start[length - 1] == '\r') --length;
    *line = std::string_view(start, length);
    return true;
  }
}

bool trace_reader::next(trace_file_event* out) {
  std::string_view line;
  if (!next_line(&line)) return false;
  if (line.empty()) fail(line_, "empty line (expected action,addr,size,stream)");

  std::string_view fields[k_column_count];
  int columns = 0;
  std::size_t pos = 0;
  for (;;) {
    const std::size_t comma = line.find(',', pos);
    if (columns < k_column_count) fields[columns] = line.substr(pos, comma - pos);
    ++columns;
    if (comma == std::string_view::npos) break;
    pos = comma + 1;
  }
  if (columns != k_column_count) {
    fail(line_, "expected 4 columns (action,addr,size,stream), found " + std::to_string(columns));
  }
  for (int i = 0; i < k_column_count; ++i) {
    if (fields[i].empty()) fail(line_, std::string("empty ") + k_column_names[i] + " field");
  }

  std::uint64_t numbers[k_column_count - 1];
  for (int i = 1; i < k_column_count; ++i) {
    const std::string_view text = fields[i];
    std::uint64_t value = 0;
    const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
    if (ec == std::errc::result_out_of_range) {
      fail(line_, std::string(k_column_names[i]) + " " + quoted(text) + " is out of range (largest is " +
                      std::to_string(std::numeric_limits<std::uint64_t>::max()) + ")");
    }
    if (ec != std::errc() || end != text.data() + text.size()) {
      fail(line_, std::string(k_column_names[i]) + " " + quoted(text) + " is not an unsigned decimal number");
    }
    numbers[i - 1] = value;
  }

  if (!parse_action(fields[0], &out->action)) {
    fail(line_, "unknown action " + quoted(fields[0]) + " (known: " + known_action_list() + ")");
  }
  out->addr = numbers[0];
  out->size = numbers[1];
  out->stream = numbers[2];
  out->line = line_;
  return true;
}

std::vector<trace_file_event> load_trace(const std::string& path) {
  trace_reader reader(path);
  std::vector<trace_file_event> events;
  trace_file_event event;
  while (reader.next(&event)) events.push_back(event);
  return events;
}

}  // namespace streamalloc
