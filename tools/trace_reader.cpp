// Allocation-trace reader: zlib's gz* API reads gzip and plain files alike
// (it checks the magic bytes), lines are cut out of a large buffer with
// memchr and parsed in place, so a 35k-line trace parses in milliseconds.
#include "trace_reader.hpp"

#include <zlib.h>

#include <cctype>
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

// The tally's entry for names past trace_reader::k_max_skipped_names.
constexpr const char* k_other_names = "(other names)";

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

// False for a name outside k_actions: a trace from a newer torch or from
// another tool. Its line is skipped and tallied, never silently.
bool parse_action(std::string_view name, trace_file_action* out) {
  for (const action_name& known : k_actions) {
    if (name == known.name) {
      *out = known.action;
      return true;
    }
  }
  return false;
}

// Splits a CSV line into fields. A field in double quotes may hold commas
// (a doubled quote inside stands for one and is kept doubled: no field the
// replay reads holds one); the quotes are left out. False for an
// unterminated quote or text after a closing quote.
bool split_csv(std::string_view line, std::vector<std::string_view>* fields) {
  fields->clear();
  std::size_t pos = 0;
  for (;;) {
    if (pos < line.size() && line[pos] == '"') {
      std::size_t close = pos + 1;
      for (;;) {
        close = line.find('"', close);
        if (close == std::string_view::npos) return false;
        if (close + 1 < line.size() && line[close + 1] == '"') {
          close += 2;
          continue;
        }
        break;
      }
      fields->push_back(line.substr(pos + 1, close - pos - 1));
      pos = close + 1;
      if (pos == line.size()) return true;
      if (line[pos] != ',') return false;
      ++pos;
      continue;
    }
    const std::size_t comma = line.find(',', pos);
    fields->push_back(line.substr(pos, comma - pos));
    if (comma == std::string_view::npos) return true;
    pos = comma + 1;
  }
}

// True for "" and for ".0", ".00", ...: what follows the digits of a whole
// number written as a float, as a CSV written by pandas does when a column
// also holds an empty cell (an oom entry's address).
bool only_zero_decimals(std::string_view rest) {
  if (rest.empty()) return true;
  if (rest.size() < 2 || rest.front() != '.') return false;
  return rest.find_first_not_of('0', 1) == std::string_view::npos;
}

enum class number_outcome { ok, out_of_range, malformed };

// A trace's numbers: decimal digits, maybe written as a float with no
// fraction, or hexadecimal after "0x" (how pointers and stream handles are
// often printed).
number_outcome parse_whole_number(std::string_view text, std::uint64_t* value) {
  const bool hex = text.size() > 2 && text[0] == '0' && (text[1] == 'x' || text[1] == 'X');
  const char* first = text.data() + (hex ? 2 : 0);
  const char* last = text.data() + text.size();
  const auto [end, ec] = std::from_chars(first, last, *value, hex ? 16 : 10);
  if (ec == std::errc::result_out_of_range) return number_outcome::out_of_range;
  if (ec != std::errc()) return number_outcome::malformed;
  const std::string_view rest(end, static_cast<std::size_t>(last - end));
  return (hex ? rest.empty() : only_zero_decimals(rest)) ? number_outcome::ok : number_outcome::malformed;
}

std::string_view trim(std::string_view text) {
  while (!text.empty() && std::isspace(static_cast<unsigned char>(text.front()))) text.remove_prefix(1);
  while (!text.empty() && std::isspace(static_cast<unsigned char>(text.back()))) text.remove_suffix(1);
  return text;
}

std::string lowercase(std::string_view text) {
  std::string out(text);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
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
  read_header();
}

void trace_reader::read_header() {
  std::string_view header;
  if (!next_line(&header)) fail(1, "empty trace: expected header '" + std::string(k_header) + "'");
  constexpr std::string_view k_utf8_bom = "\xEF\xBB\xBF";  // spreadsheet programs write one
  if (header.substr(0, k_utf8_bom.size()) == k_utf8_bom) header.remove_prefix(k_utf8_bom.size());
  header_ = std::string(header);
  if (header == k_header) return;  // the format's own order, the common case
  std::vector<std::string_view> names;
  const bool split = split_csv(header, &names);
  bool found[k_column_count] = {};
  for (std::size_t i = 0; split && i < names.size(); ++i) {
    const std::string name = lowercase(trim(names[i]));
    for (int c = 0; c < k_column_count; ++c) {
      if (name != k_column_names[c]) continue;
      if (found[c]) fail(1, "the header " + quoted(header) + " names column '" + name + "' twice");
      found[c] = true;
      field_index_[c] = i;
    }
  }
  std::string missing;
  for (int c = 0; c < k_column_count; ++c) {
    if (found[c]) continue;
    if (!missing.empty()) missing += ", ";
    missing += std::string("'") + k_column_names[c] + "'";
  }
  if (!missing.empty()) {
    fail(1, "expected header '" + std::string(k_header) + "' (those columns in any order; others are ignored), found " +
                quoted(header) + ", which lacks " + missing);
  }
  columns_ = names.size();
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

void trace_reader::skip(std::string_view action) {
  for (skipped_action& known : skipped_) {
    if (known.name == action) {
      ++known.lines;
      return;
    }
  }
  if (skipped_.size() + 1 == k_max_skipped_names) {
    skipped_.push_back({k_other_names, 1, line_});
  } else if (skipped_.size() == k_max_skipped_names) {
    ++skipped_.back().lines;
  } else {
    skipped_.push_back({std::string(action), 1, line_});
  }
}

bool trace_reader::next(trace_file_event* out) {
  std::string_view line;
  if (!next_line(&line)) return false;
  if (line.empty()) fail(line_, "empty line (expected " + header_ + ")");

  if (!split_csv(line, &fields_)) fail(line_, "a quoted field without its closing quote, or text after it");
  if (fields_.size() != columns_) {
    fail(line_, "expected " + std::to_string(columns_) + " columns (" + header_ + "), found " +
                    std::to_string(fields_.size()));
  }
  std::string_view fields[k_column_count];
  for (int i = 0; i < k_column_count; ++i) fields[i] = fields_[field_index_[i]];
  if (fields[0].empty()) fail(line_, "empty action field");
  out->line = line_;
  const bool known = parse_action(fields[0], &out->action);
  if (out->action == trace_file_action::other || !known) {
    // Not replayed, so not read further: an oom line may carry no address.
    // The format says to ignore unknown actions; the tally says they were.
    if (!known) skip(fields[0]);
    out->action = trace_file_action::other;
    out->addr = out->size = out->stream = 0;
    return true;
  }
  for (int i = 1; i < k_column_count; ++i) {
    if (fields[i].empty()) fail(line_, std::string("empty ") + k_column_names[i] + " field");
  }

  std::uint64_t numbers[k_column_count - 1];
  for (int i = 1; i < k_column_count; ++i) {
    const std::string_view text = fields[i];
    std::uint64_t value = 0;
    switch (parse_whole_number(text, &value)) {
      case number_outcome::ok:
        break;
      case number_outcome::out_of_range:
        fail(line_, std::string(k_column_names[i]) + " " + quoted(text) + " is out of range (largest is " +
                        std::to_string(std::numeric_limits<std::uint64_t>::max()) + ")");
      case number_outcome::malformed:
        fail(line_, std::string(k_column_names[i]) + " " + quoted(text) +
                        " is not an unsigned whole number (decimal, or hexadecimal after 0x)");
    }
    numbers[i - 1] = value;
  }
  out->addr = numbers[0];
  out->size = numbers[1];
  out->stream = numbers[2];
  return true;
}

std::vector<trace_file_event> load_trace(const std::string& path, std::vector<skipped_action>* skipped) {
  trace_reader reader(path);
  std::vector<trace_file_event> events;
  trace_file_event event;
  while (reader.next(&event)) events.push_back(event);
  if (skipped != nullptr) *skipped = reader.skipped_actions();
  return events;
}

}  // namespace streamalloc
