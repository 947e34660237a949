#include "streamalloc/util/shared_chunks.hpp"

#include <cstdint>
#include <cstring>

namespace streamalloc {
namespace {

constexpr std::size_t k_pid_field = 8;  // a 4-byte pid and 4 zero bytes
constexpr std::size_t k_header_bytes = k_pid_field + 2 * sizeof(std::uint64_t);

template <typename T>
void append(std::string* out, T value) {
  char bytes[sizeof(T)];
  std::memcpy(bytes, &value, sizeof(T));
  out->append(bytes, sizeof(T));
}

template <typename T>
T read_at(std::string_view bytes, std::size_t at) {
  T value;
  std::memcpy(&value, bytes.data() + at, sizeof(T));
  return value;
}

}  // namespace

std::string encode_shared_chunks(const shared_chunks& chunks) {
  std::string out;
  out.reserve(k_header_bytes + chunks.fds.size() * sizeof(std::int32_t));
  append<std::int32_t>(&out, chunks.pid);
  out.append(k_pid_field - sizeof(std::int32_t), '\0');
  append<std::uint64_t>(&out, chunks.chunk_bytes);
  append<std::uint64_t>(&out, chunks.fds.size());
  for (const int fd : chunks.fds) append<std::int32_t>(&out, fd);
  return out;
}

bool decode_shared_chunks(std::string_view bytes, shared_chunks* out) {
  if (out == nullptr || bytes.size() < k_header_bytes) return false;
  const auto chunk_bytes = read_at<std::uint64_t>(bytes, k_pid_field);
  const auto count = read_at<std::uint64_t>(bytes, k_pid_field + sizeof(std::uint64_t));
  const std::size_t fd_bytes = bytes.size() - k_header_bytes;
  if (chunk_bytes == 0 || count == 0 || fd_bytes % sizeof(std::int32_t) != 0 ||
      fd_bytes / sizeof(std::int32_t) != count) {
    return false;
  }
  out->pid = read_at<std::int32_t>(bytes, 0);
  out->chunk_bytes = static_cast<std::size_t>(chunk_bytes);
  out->fds.clear();
  for (std::size_t at = k_header_bytes; at < bytes.size(); at += sizeof(std::int32_t)) {
    out->fds.push_back(read_at<std::int32_t>(bytes, at));
  }
  return true;
}

}  // namespace streamalloc
