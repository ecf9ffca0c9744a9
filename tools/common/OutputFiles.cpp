//===- OutputFiles.cpp - complete output files, private scratch folders ---===//
#include "common/OutputFiles.h"

#include "dualkv/Bounded.h"

#include <fmt/format.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <thread>
#include <utility>

#include <fcntl.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

extern char **environ;

namespace dualkv::tools {
namespace {

/// Closes a descriptor when it goes out of scope.
struct Closer {
  int fd = -1;
  ~Closer() {
    if (fd >= 0)
      ::close(fd);
  }
};

/// Writes all of `bytes` to `fd`; empty, or why not. A short write is
/// retried, so only a real error (ENOSPC, EFBIG, EIO) ends it early.
std::string writeAll(int fd, std::string_view bytes) {
  while (!bytes.empty()) {
    ssize_t n = ::write(fd, bytes.data(), bytes.size());
    if (n < 0 && errno == EINTR)
      continue;
    if (n <= 0)
      return std::strerror(n < 0 ? errno : EIO);
    bytes.remove_prefix(static_cast<size_t>(n));
  }
  return {};
}

/// Writes `bytes` to the new file `fd` and closes it: data on disk (fsync,
/// where a full disk or a network file system may only now say no), the
/// size as written, the close without error. Empty, or why not.
std::string finishFile(int fd, std::string_view bytes) {
  std::string why = writeAll(fd, bytes);
  struct stat st;
  if (why.empty() && ::fsync(fd) != 0)
    why = std::strerror(errno);
  if (why.empty() && ::fstat(fd, &st) != 0)
    why = std::strerror(errno);
  if (why.empty() && static_cast<uint64_t>(st.st_size) != bytes.size())
    why = fmt::format("{} bytes on disk, not {}", st.st_size, bytes.size());
  if (::close(fd) != 0 && why.empty())
    why = std::strerror(errno);
  return why;
}

} // namespace

std::string writeFileAtomically(const std::string &dir, const std::string &name,
                                std::string_view bytes) {
  auto fail = [&](const std::string &why) {
    return fmt::format("cannot write {}/{}: {}", dir, name, why);
  };
  Closer folder{::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC)};
  if (folder.fd < 0)
    return fail(std::strerror(errno));
  // The temp name is short whatever `name` is, so that only a `name` the
  // file system cannot hold fails (ENAMETOOLONG at the rename).
  static std::atomic<unsigned> counter{0};
  std::string tmp;
  int fd = -1;
  for (int attempt = 0; attempt < 100 && fd < 0; ++attempt) {
    tmp = fmt::format(".dualkv.{}.{}.tmp", ::getpid(), counter++);
    fd = ::openat(folder.fd, tmp.c_str(),
                  O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0666);
    if (fd < 0 && errno != EEXIST)
      break;
  }
  if (fd < 0)
    return fail(
        fmt::format("cannot create a temp file: {}", std::strerror(errno)));
  std::string why = finishFile(fd, bytes);
  if (why.empty() &&
      ::renameat(folder.fd, tmp.c_str(), folder.fd, name.c_str()) != 0)
    why = std::strerror(errno);
  if (why.empty())
    return {};
  ::unlinkat(folder.fd, tmp.c_str(), 0);
  return fail(why);
}

void removeFile(const std::string &dir, const std::string &name) {
  Closer folder{::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC)};
  if (folder.fd >= 0)
    ::unlinkat(folder.fd, name.c_str(), 0);
}

std::optional<ScratchFolder> ScratchFolder::create(const std::string &prefix,
                                                   std::string *why) {
  std::string base = envValue("TMPDIR").value_or("/tmp");
  std::string path = base + "/" + prefix + ".XXXXXX";
  if (!::mkdtemp(path.data())) {
    *why = fmt::format("cannot create a scratch folder in {}: {}", base,
                       std::strerror(errno));
    return std::nullopt;
  }
  int fd =
      ::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) {
    *why = fmt::format("cannot open the scratch folder {}: {}", path,
                       std::strerror(errno));
    ::rmdir(path.c_str());
    return std::nullopt;
  }
  return ScratchFolder(std::move(path), fd);
}

ScratchFolder::ScratchFolder(ScratchFolder &&o) noexcept
    : path_(std::move(o.path_)), fd_(std::exchange(o.fd_, -1)) {
  o.path_.clear();
}

ScratchFolder::~ScratchFolder() {
  if (fd_ >= 0)
    ::close(fd_);
  // Links inside are removed, never followed.
  if (!path_.empty()) {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
}

std::string ScratchFolder::write(const std::string &name,
                                 std::string_view bytes) const {
  int fd = ::openat(fd_, name.c_str(),
                    O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (fd < 0)
    return fmt::format("cannot create {}/{}: {}", path_, name,
                       std::strerror(errno));
  std::string why = finishFile(fd, bytes);
  if (why.empty())
    return {};
  ::unlinkat(fd_, name.c_str(), 0);
  return fmt::format("cannot write {}/{}: {}", path_, name, why);
}

std::string runInFolder(const std::vector<std::string> &argv,
                        const ScratchFolder &scratch,
                        const std::string &logName, int timeoutSeconds) {
  Closer log{::openat(scratch.fd(), logName.c_str(),
                      O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC,
                      0600)};
  if (log.fd < 0)
    return fmt::format("cannot create its log: {}", std::strerror(errno));
  std::vector<char *> args;
  for (const std::string &a : argv)
    args.push_back(const_cast<char *>(a.c_str()));
  args.push_back(nullptr);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addfchdir_np(&actions, scratch.fd());
  posix_spawn_file_actions_adddup2(&actions, log.fd, STDOUT_FILENO);
  posix_spawn_file_actions_adddup2(&actions, log.fd, STDERR_FILENO);
  posix_spawn_file_actions_addopen(&actions, STDIN_FILENO, "/dev/null",
                                   O_RDONLY, 0);
  pid_t pid = 0;
  int spawned =
      posix_spawn(&pid, args[0], &actions, nullptr, args.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  if (spawned != 0)
    return fmt::format("cannot run it: {}", std::strerror(spawned));
  // Polled, so that a program that hangs is killed rather than waited for.
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::seconds(timeoutSeconds);
  int status = 0;
  bool killed = false;
  for (;;) {
    pid_t done = ::waitpid(pid, &status, WNOHANG);
    if (done == pid)
      break;
    if (done < 0 && errno != EINTR)
      return fmt::format("cannot wait for it: {}", std::strerror(errno));
    if (!killed && std::chrono::steady_clock::now() > deadline) {
      ::kill(pid, SIGKILL);
      killed = true;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  if (killed)
    return fmt::format("killed after {} s", timeoutSeconds);
  if (WIFSIGNALED(status))
    return fmt::format("killed by signal {}", WTERMSIG(status));
  if (WEXITSTATUS(status) != 0)
    return fmt::format("exit status {}", WEXITSTATUS(status));
  return {};
}

} // namespace dualkv::tools
