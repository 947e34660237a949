// temp_dir: a fresh directory under the system temp dir for test files,
// removed with its contents when the test ends.
#pragma once

#include <stdlib.h>
#include <zlib.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <stdexcept>
#include <string>
#include <system_error>

namespace streamalloc::test {

class temp_dir {
 public:
  temp_dir() {
    std::string pattern = (std::filesystem::temp_directory_path() / "streamalloc_test_XXXXXX").string();
    if (mkdtemp(pattern.data()) == nullptr) throw std::runtime_error("mkdtemp failed for " + pattern);
    path_ = pattern;
  }
  ~temp_dir() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }
  temp_dir(const temp_dir&) = delete;
  temp_dir& operator=(const temp_dir&) = delete;

  const std::filesystem::path& path() const { return path_; }

  // Writes `content` as is; returns the file's path.
  std::string write(const std::string& name, const std::string& content) const {
    const std::string path = (path_ / name).string();
    std::ofstream out(path, std::ios::binary);
    out << content;
    if (!out) throw std::runtime_error("cannot write " + path);
    return path;
  }

  // Writes `content` gzip-compressed; returns the file's path.
  std::string write_gzip(const std::string& name, const std::string& content) const {
    const std::string path = (path_ / name).string();
    gzFile file = gzopen(path.c_str(), "wb");
    if (file == nullptr) throw std::runtime_error("gzopen failed for " + path);
    const int written = gzwrite(file, content.data(), static_cast<unsigned>(content.size()));
    if (gzclose(file) != Z_OK || written != static_cast<int>(content.size())) {
      throw std::runtime_error("gzwrite failed for " + path);
    }
    return path;
  }

  static std::string read_bytes(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }

 private:
  std::filesystem::path path_;
};

}  // namespace streamalloc::test
