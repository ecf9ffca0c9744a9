// Reading files the library did not just write: type, size and owner checked
// on the opened descriptor before a byte is read.
#include "cache/Files.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <cerrno>
#include <cstring>
#include <limits>
#include <system_error>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

namespace dualkv {

FileDescriptor &FileDescriptor::operator=(FileDescriptor &&o) noexcept {
  if (this != &o) {
    if (fd_ >= 0)
      ::close(fd_);
    fd_ = o.release();
  }
  return *this;
}

FileDescriptor::~FileDescriptor() {
  if (fd_ >= 0)
    ::close(fd_);
}

const char *fileTypeName(mode_t mode) {
  if (S_ISREG(mode))
    return "a regular file";
  if (S_ISDIR(mode))
    return "a directory";
  if (S_ISFIFO(mode))
    return "a FIFO";
  if (S_ISCHR(mode))
    return "a character device";
  if (S_ISBLK(mode))
    return "a block device";
  if (S_ISSOCK(mode))
    return "a socket";
  if (S_ISLNK(mode))
    return "a symbolic link";
  return "not a regular file";
}

llvm::Error checkTrusted(uid_t owner, mode_t mode) {
  if (owner != ::geteuid())
    return invalidArgument(fmt::format(
        "it belongs to uid {}, not to this user (uid {})", owner, ::geteuid()));
  if (mode & (S_IWGRP | S_IWOTH))
    return invalidArgument(fmt::format(
        "group or others may write it (mode {:04o})", mode & 07777));
  return llvm::Error::success();
}

bool isMissingFile(const ErrorParts &parts) {
  return parts.cause == std::errc::no_such_file_or_directory;
}

llvm::Expected<std::string> readFileChecked(int dirFd, const std::string &path,
                                            const FileRules &rules) {
  auto fail = [&](const std::string &reason, std::error_code cause = {}) {
    return makeError(ErrorCode::InvalidArgument,
                     fmt::format("{} {}", path, reason), cause);
  };
  // A look before opening spares a device the open; the checks that count
  // are the ones on the opened descriptor below.
  struct stat st;
  if (::fstatat(dirFd, path.c_str(), &st,
                rules.noFollow ? AT_SYMLINK_NOFOLLOW : 0) == 0) {
    if (S_ISLNK(st.st_mode))
      return fail("is a symbolic link, which is not followed here");
    if (!S_ISREG(st.st_mode))
      return fail(
          fmt::format("is {}, not a regular file", fileTypeName(st.st_mode)));
  }
  int flags = O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK;
  if (rules.noFollow)
    flags |= O_NOFOLLOW;
  FileDescriptor fd(::openat(dirFd, path.c_str(), flags));
  if (!fd) {
    int err = errno;
    if (err == ELOOP && rules.noFollow)
      return fail("is a symbolic link, which is not followed here");
    return fail(fmt::format("cannot be opened: {}", std::strerror(err)),
                std::error_code(err, std::generic_category()));
  }
  if (::fstat(fd.get(), &st) != 0)
    return fail(fmt::format("cannot be examined: {}", std::strerror(errno)));
  if (!S_ISREG(st.st_mode))
    return fail(
        fmt::format("is {}, not a regular file", fileTypeName(st.st_mode)));
  if (rules.ownedOnly)
    if (llvm::Error untrusted = checkTrusted(st.st_uid, st.st_mode))
      return fail("is not trusted: " + llvm::toString(std::move(untrusted)));
  if (st.st_size < 0 || static_cast<uint64_t>(st.st_size) > rules.maxBytes)
    return fail(fmt::format("is {} bytes, more than the {} allowed", st.st_size,
                            rules.maxBytes));
  // Read one byte past the size: a file that grows meanwhile is refused
  // rather than read forever.
  const size_t size = static_cast<size_t>(st.st_size);
  std::string bytes(size + 1, '\0');
  size_t done = 0;
  while (done < bytes.size()) {
    ssize_t n = ::read(fd.get(), bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR)
      continue;
    if (n < 0)
      return fail(fmt::format("cannot be read: {}", std::strerror(errno)));
    if (n == 0)
      break;
    done += static_cast<size_t>(n);
  }
  if (done != size)
    return fail(fmt::format("changed size while being read ({} bytes, then "
                            "{})",
                            size, done));
  bytes.resize(size);
  return bytes;
}

std::optional<int64_t> jsonInteger(const nlohmann::json &v, int64_t lo,
                                   int64_t hi) {
  int64_t value = 0;
  if (v.is_number_unsigned()) {
    // nlohmann keeps non-negative integers unsigned: 2^64 - 1 included.
    const uint64_t u = v.get<uint64_t>();
    if (u > uint64_t(std::numeric_limits<int64_t>::max()))
      return std::nullopt;
    value = static_cast<int64_t>(u);
  } else if (v.is_number_integer()) {
    value = v.get<int64_t>();
  } else {
    return std::nullopt;
  }
  if (value < lo || value > hi)
    return std::nullopt;
  return value;
}

bool jsonNestsDeeperThan(std::string_view text, int maxDepth) {
  int depth = 0;
  bool inString = false;
  for (size_t i = 0; i < text.size(); ++i) {
    char c = text[i];
    if (inString) {
      if (c == '\\')
        ++i;
      else if (c == '"')
        inString = false;
    } else if (c == '"') {
      inString = true;
    } else if (c == '[' || c == '{') {
      if (++depth > maxDepth)
        return true;
    } else if ((c == ']' || c == '}') && depth > 0) {
      --depth;
    }
  }
  return false;
}

} // namespace dualkv
