// Tests for the encoding of exported chunks in CUDA IPC handles
// (streamalloc/util/shared_chunks.hpp): torch's header layout byte for
// byte, one string per range, and malformed input refused.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "streamalloc/util/shared_chunks.hpp"
#include "support/catch.hpp"

using streamalloc::decode_shared_chunks;
using streamalloc::encode_shared_chunks;
using streamalloc::shared_chunks;

namespace {

template <typename T>
T field(const std::string& bytes, std::size_t at) {
  T value;
  std::memcpy(&value, bytes.data() + at, sizeof(T));
  return value;
}

// torch's header for expandable segments, as a struct: its padding after
// the pid is what the encoding must fill with zeros.
struct torch_share_header {
  std::int32_t pid;
  std::size_t segment_size;
  std::size_t num_handles;
};

}  // namespace

TEST_CASE("shared chunks encode in torch's header layout with zero padding", "[shared_chunks]") {
  const shared_chunks chunks{4242, std::size_t{2} << 20, {17, 55, 3}};
  const std::string bytes = encode_shared_chunks(chunks);
  REQUIRE(bytes.size() == sizeof(torch_share_header) + 3 * sizeof(std::int32_t));
  CHECK(field<std::int32_t>(bytes, offsetof(torch_share_header, pid)) == 4242);
  CHECK(field<std::int32_t>(bytes, sizeof(std::int32_t)) == 0);
  CHECK(field<std::size_t>(bytes, offsetof(torch_share_header, segment_size)) == (std::size_t{2} << 20));
  CHECK(field<std::size_t>(bytes, offsetof(torch_share_header, num_handles)) == 3);
  CHECK(field<std::int32_t>(bytes, sizeof(torch_share_header)) == 17);
  CHECK(field<std::int32_t>(bytes, sizeof(torch_share_header) + 8) == 3);
}

TEST_CASE("one range encodes to one string, and decodes back", "[shared_chunks]") {
  const shared_chunks chunks{77, 1 << 21, {9, 10}};
  CHECK(encode_shared_chunks(chunks) == encode_shared_chunks(shared_chunks{77, 1 << 21, {9, 10}}));
  CHECK(encode_shared_chunks(chunks) != encode_shared_chunks(shared_chunks{77, 1 << 21, {9, 11}}));
  CHECK(encode_shared_chunks(chunks) != encode_shared_chunks(shared_chunks{78, 1 << 21, {9, 10}}));

  shared_chunks back;
  REQUIRE(decode_shared_chunks(encode_shared_chunks(chunks), &back));
  CHECK(back.pid == 77);
  CHECK(back.chunk_bytes == (1u << 21));
  CHECK(back.fds == std::vector<int>{9, 10});
}

TEST_CASE("malformed shared chunks are refused", "[shared_chunks]") {
  const std::string good = encode_shared_chunks(shared_chunks{5, 1 << 21, {4, 6}});
  shared_chunks out;
  CHECK_FALSE(decode_shared_chunks(good.substr(0, 10), &out));               // short header
  CHECK_FALSE(decode_shared_chunks(good.substr(0, good.size() - 1), &out));  // torn descriptor
  CHECK_FALSE(decode_shared_chunks(good.substr(0, good.size() - 4), &out));  // count says two
  CHECK_FALSE(decode_shared_chunks(good + std::string(4, '\0'), &out));      // one too many
  CHECK_FALSE(decode_shared_chunks(encode_shared_chunks(shared_chunks{5, 0, {4}}), &out));
  CHECK_FALSE(decode_shared_chunks(encode_shared_chunks(shared_chunks{5, 1 << 21, {}}), &out));
  CHECK_FALSE(decode_shared_chunks(good, nullptr));
  CHECK(decode_shared_chunks(good, &out));
}
