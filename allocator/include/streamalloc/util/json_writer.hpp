// json_writer: the one JSON emitter of the command-line tools and benches
// (streamalloc-replay --json, streamalloc-bench --json). Header-only and
// free of the core so any layer may use it: a string escaper and a writer
// that keeps track of commas so callers only say what goes where.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace streamalloc {

// Appends `text` to *out as a JSON string literal: quoted, with '"', '\\'
// and every control character escaped. Bytes of 0x80 and above pass through
// unchanged (UTF-8 stays UTF-8).
inline void append_json_string(std::string* out, std::string_view text) {
  out->push_back('"');
  for (const char c : text) {
    switch (c) {
      case '"': *out += "\\\""; break;
      case '\\': *out += "\\\\"; break;
      case '\n': *out += "\\n"; break;
      case '\r': *out += "\\r"; break;
      case '\t': *out += "\\t"; break;
      case '\b': *out += "\\b"; break;
      case '\f': *out += "\\f"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char escaped[8];
          std::snprintf(escaped, sizeof escaped, "\\u%04x", static_cast<unsigned>(static_cast<unsigned char>(c)));
          *out += escaped;
        } else {
          out->push_back(c);
        }
    }
  }
  out->push_back('"');
}

// `text` as a JSON string literal.
inline std::string json_string(std::string_view text) {
  std::string out;
  out.reserve(text.size() + 2);
  append_json_string(&out, text);
  return out;
}

// Builds one JSON document in a string: objects and arrays nest, members
// are separated by ", " and keys by ": " (one line, easy to grep). Misuse
// (a value where a key is due, closing what is not open) throws
// std::logic_error.
//
//   json_writer w;
//   w.begin_object().key("trace").value(path).key("ratio").value(1.004, 6).end_object();
//   std::puts(w.str().c_str());
class json_writer {
 public:
  json_writer& begin_object() {
    open_value();
    text_.push_back('{');
    scopes_.push_back({true, true, false});
    return *this;
  }
  json_writer& end_object() { return close(true, '}'); }
  json_writer& begin_array() {
    open_value();
    text_.push_back('[');
    scopes_.push_back({false, true, false});
    return *this;
  }
  json_writer& end_array() { return close(false, ']'); }

  // The next member's key; only inside an object, before each value.
  json_writer& key(std::string_view name) {
    if (scopes_.empty() || !scopes_.back().object || scopes_.back().after_key) {
      throw std::logic_error("json_writer: key outside an object or two keys in a row");
    }
    separate();
    append_json_string(&text_, name);
    text_ += ": ";
    scopes_.back().after_key = true;
    return *this;
  }

  json_writer& value(std::string_view text) {
    open_value();
    append_json_string(&text_, text);
    return *this;
  }
  json_writer& value(const char* text) { return value(std::string_view(text)); }
  json_writer& value(const std::string& text) { return value(std::string_view(text)); }
  json_writer& value(bool flag) { return raw(flag ? "true" : "false"); }
  json_writer& value(int number) { return raw(std::to_string(number)); }
  json_writer& value(long number) { return raw(std::to_string(number)); }
  json_writer& value(long long number) { return raw(std::to_string(number)); }
  json_writer& value(unsigned number) { return raw(std::to_string(number)); }
  json_writer& value(unsigned long number) { return raw(std::to_string(number)); }
  json_writer& value(unsigned long long number) { return raw(std::to_string(number)); }
  // A fixed-point number with `decimals` digits after the point; NaN and
  // infinities, which JSON cannot spell, become null.
  json_writer& value(double number, int decimals = 6) {
    if (!std::isfinite(number)) return null();
    char buffer[64];
    std::snprintf(buffer, sizeof buffer, "%.*f", decimals, number);
    return raw(buffer);
  }
  json_writer& null() { return raw("null"); }

  // Starts the next member or element on a new line, indented two spaces
  // a level (for documents people read).
  json_writer& newline() {
    newline_ = true;
    return *this;
  }

  // Text already in JSON form (a number formatted by the caller).
  json_writer& raw(std::string_view json) {
    open_value();
    text_.append(json);
    return *this;
  }

  // The document so far; complete once every object and array is closed.
  const std::string& str() const { return text_; }
  bool complete() const { return scopes_.empty() && !text_.empty(); }

 private:
  struct scope {
    bool object;
    bool first;
    bool after_key;
  };

  void separate() {
    scope& s = scopes_.back();
    if (!s.first) text_ += newline_ ? "," : ", ";
    if (newline_) text_ += "\n" + std::string(2 * scopes_.size(), ' ');
    newline_ = false;
    s.first = false;
  }

  // Places a value: after a key in an object, after a separator in an
  // array, or as the whole document.
  void open_value() {
    if (scopes_.empty()) {
      if (!text_.empty()) throw std::logic_error("json_writer: a second top-level value");
      return;
    }
    scope& s = scopes_.back();
    if (s.object) {
      if (!s.after_key) throw std::logic_error("json_writer: a value inside an object without a key");
      s.after_key = false;
    } else {
      separate();
    }
  }

  json_writer& close(bool object, char bracket) {
    if (scopes_.empty() || scopes_.back().object != object || scopes_.back().after_key) {
      throw std::logic_error(std::string("json_writer: unbalanced '") + bracket + "'");
    }
    scopes_.pop_back();
    if (newline_) text_ += "\n" + std::string(2 * scopes_.size(), ' ');
    newline_ = false;
    text_.push_back(bracket);
    return *this;
  }

  std::string text_;
  std::vector<scope> scopes_;
  bool newline_ = false;
};

}  // namespace streamalloc
