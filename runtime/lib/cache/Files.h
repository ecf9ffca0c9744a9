// Reading files the library did not just write: nothing but a regular file of
// bounded size is ever read, and no open or read can block.
#ifndef DUALKV_RUNTIME_CACHE_FILES_H
#define DUALKV_RUNTIME_CACHE_FILES_H

#include "support/Status.h"

#include <nlohmann/json_fwd.hpp>

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace dualkv {

/// An open file descriptor, closed when the handle dies.
class FileDescriptor {
public:
  FileDescriptor() = default;
  explicit FileDescriptor(int fd) : fd_(fd) {}
  FileDescriptor(FileDescriptor &&o) noexcept : fd_(o.release()) {}
  FileDescriptor &operator=(FileDescriptor &&o) noexcept;
  FileDescriptor(const FileDescriptor &) = delete;
  FileDescriptor &operator=(const FileDescriptor &) = delete;
  ~FileDescriptor();

  int get() const { return fd_; }
  explicit operator bool() const { return fd_ >= 0; }
  int release() {
    int fd = fd_;
    fd_ = -1;
    return fd;
  }

private:
  int fd_ = -1;
};

/// How readFileChecked opens and vets a file.
struct FileRules {
  size_t maxBytes = 0;   ///< larger files are refused before any read
  bool noFollow = false; ///< a symbolic link is refused (O_NOFOLLOW)
  /// The file must belong to this process's effective user and nobody else
  /// may write it (mode without 022).
  bool ownedOnly = false;
};

/// The whole regular file `path` (relative to the directory `dirFd`, or to
/// the working directory with AT_FDCWD). It is opened non-blocking (a FIFO
/// cannot hang the open), checked with fstat on the opened descriptor (type,
/// size, and with ownedOnly owner and mode) and read up to its size. Any
/// refusal is an InvalidArgument error whose message starts with `path`; a
/// file that simply does not exist is one whose cause is
/// std::errc::no_such_file_or_directory (isMissingFile).
llvm::Expected<std::string> readFileChecked(int dirFd, const std::string &path,
                                            const FileRules &rules);

/// Whether `parts` (takeErrorParts of a readFileChecked error) says that the
/// file does not exist.
bool isMissingFile(const ErrorParts &parts);

/// An InvalidArgument error when an fstat result is not a file or folder this
/// user alone controls (another owner, or writable by group or others),
/// saying why; success when it is.
llvm::Error checkTrusted(uid_t owner, mode_t mode);

/// A short name for a file type ("a FIFO", "a directory", ...) for messages.
const char *fileTypeName(mode_t mode);

/// True when the JSON text `text` nests arrays and objects more than
/// `maxDepth` deep (brackets inside strings do not count). Checked before
/// parsing, since printing or destroying a deep document recurses once per
/// level.
bool jsonNestsDeeperThan(std::string_view text, int maxDepth);

/// The JSON value `v` as an integer in [lo, hi], or nothing when it is not a
/// JSON integer (a fraction such as 128.9, a float such as 1e300 or 128.0, a
/// bool, a string) or lies outside the range: no value is ever converted with
/// a wrap or a truncation.
std::optional<int64_t> jsonInteger(const nlohmann::json &v, int64_t lo,
                                   int64_t hi);

/// The deepest nesting any DualKV JSON file (cache entry, tuning database,
/// spec file) may have; theirs is 3 or less.
constexpr int kMaxJsonDepth = 32;

} // namespace dualkv

#endif
