// Reader for allocation traces (shared/traces/README.md): a CSV file, plain
// or gzip'd, with header `action,addr,size,stream` and one event a line.
// The header may name those four columns in any order and other columns
// beside them (ignored). Events are pulled one at a time
// (trace_reader::next) or loaded at once.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

struct gzFile_s;  // zlib's handle type, kept out of this header

namespace streamalloc {

enum class trace_file_action : std::uint8_t {
  alloc,
  free_requested,
  free_completed,
  segment_alloc,
  segment_free,
  segment_map,
  segment_unmap,
  other,  // oom, snapshot and actions the format does not name: not interpreted
};

// The spelling used in trace files ("other" for trace_file_action::other).
const char* to_string(trace_file_action action);

struct trace_file_event {
  trace_file_action action = trace_file_action::other;
  // An alloc the file does not hold: the block was allocated before
  // recording began (add_allocations_before_recording).
  bool before_recording = false;
  std::uint64_t addr = 0;
  std::uint64_t size = 0;
  std::uint64_t stream = 0;  // raw stream handle, 0 = default stream
  std::uint64_t line = 0;    // 1-based line in the file (the header is line 1)
};

// A trace that cannot be read, or that is inconsistent. The message is
// "<path>:<line>: <reason>" (just "<path>: <reason>" when no line applies).
class trace_error : public std::runtime_error {
 public:
  trace_error(const std::string& path, std::uint64_t line, const std::string& reason);
  const std::string& path() const noexcept { return path_; }
  std::uint64_t line() const noexcept { return line_; }  // 0 when no line applies
  const std::string& reason() const noexcept { return reason_; }

 private:
  std::string path_;
  std::uint64_t line_;
  std::string reason_;
};

// Lines whose action the format does not name (a torch with new TraceEntry
// actions, another tool's rows): read as trace_file_action::other, as the
// format says, and tallied so that the replay can say what it left out.
struct skipped_action {
  std::string name;
  std::uint64_t lines = 0;
  std::uint64_t first_line = 0;
};

class trace_reader {
 public:
  // Opens `path` (gzip or plain, told apart by the gzip magic bytes) and
  // reads the header: it must name action, addr, size and stream once each
  // (any order, any letter case); other columns are ignored. Throws
  // trace_error.
  explicit trace_reader(const std::string& path);
  ~trace_reader();
  trace_reader(const trace_reader&) = delete;
  trace_reader& operator=(const trace_reader&) = delete;

  // Stores the next event in *out and returns true, or returns false at the
  // end of the trace. Throws trace_error on a malformed line or a damaged
  // file; events before the bad line have already been returned. An oom or
  // snapshot line, or one of an action the format does not name, is
  // returned as trace_file_action::other with its numbers unread (0); the
  // latter are counted in skipped_actions().
  bool next(trace_file_event* out);

  const std::string& path() const { return path_; }
  // In order of first appearance; at most k_max_skipped_names names, the
  // rest counted under the last entry's name "(other names)".
  const std::vector<skipped_action>& skipped_actions() const { return skipped_; }
  static constexpr std::size_t k_max_skipped_names = 16;

 private:
  struct gz_closer {
    void operator()(gzFile_s* file) const;
  };

  // Returns the next line without its terminator, or false at the end.
  bool next_line(std::string_view* line);
  void refill();
  [[noreturn]] void fail(std::uint64_t line, const std::string& reason) const;
  void read_header();
  void skip(std::string_view action);

  std::string path_;
  std::unique_ptr<gzFile_s, gz_closer> file_;
  std::vector<char> buffer_;
  std::size_t begin_ = 0;  // unread bytes are buffer_[begin_, end_)
  std::size_t end_ = 0;
  bool at_eof_ = false;
  std::string stream_error_;  // zlib's complaint once input ended early or was corrupt
  std::uint64_t line_ = 0;    // lines consumed so far
  // Where the header puts each of action, addr, size, stream, and how many
  // columns every line has.
  std::size_t field_index_[4] = {0, 1, 2, 3};
  std::size_t columns_ = 4;
  std::string header_;  // as the file spells it, for messages
  std::vector<skipped_action> skipped_;
  std::vector<std::string_view> fields_;  // the current line's, reused
};

// Reads every event of `path` into memory (see trace_reader for errors);
// *skipped, when given, receives the reader's skipped_actions().
std::vector<trace_file_event> load_trace(const std::string& path, std::vector<skipped_action>* skipped = nullptr);

}  // namespace streamalloc
