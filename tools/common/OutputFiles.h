// What the tools write: output files that are complete or absent, a private
// scratch folder, and programs run from it with a time limit.
#ifndef DUALKV_TOOLS_OUTPUT_FILES_H
#define DUALKV_TOOLS_OUTPUT_FILES_H

#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace dualkv::tools {

/// Writes `bytes` to the file `name` in the folder `dir` so that it is
/// complete or not there: a temp file of this process in `dir` (created with
/// O_EXCL | O_NOFOLLOW), every write, fsync, size and close checked, then
/// renamed over `name` (which replaces a link there instead of following it).
/// On failure the temp file is removed and the result is "cannot write
/// <dir>/<name>: <why>" (an old `name` stays as it was); on success it is
/// empty.
std::string writeFileAtomically(const std::string &dir, const std::string &name,
                                std::string_view bytes);

/// Removes `dir`/`name` if it is there (a file this tool wrote).
void removeFile(const std::string &dir, const std::string &name);

/// A folder only this process uses: mkdtemp(3) makes it 0700 under $TMPDIR
/// (else /tmp) with a name nobody can predict, and it goes with everything in
/// it when the object dies, whichever way the function that made it returns.
class ScratchFolder {
public:
  /// A new folder named "<prefix>.XXXXXX"; nothing with *why on failure.
  static std::optional<ScratchFolder> create(const std::string &prefix,
                                             std::string *why);
  ScratchFolder(ScratchFolder &&o) noexcept;
  ScratchFolder &operator=(ScratchFolder &&) = delete;
  ScratchFolder(const ScratchFolder &) = delete;
  ScratchFolder &operator=(const ScratchFolder &) = delete;
  ~ScratchFolder();

  const std::string &path() const { return path_; }
  int fd() const { return fd_; }

  /// Creates the file `name` in the folder (O_CREAT | O_EXCL | O_NOFOLLOW,
  /// 0600) and writes `bytes`, every write and the close checked; empty on
  /// success, else why.
  std::string write(const std::string &name, std::string_view bytes) const;

private:
  ScratchFolder(std::string path, int fd) : path_(std::move(path)), fd_(fd) {}
  std::string path_;
  int fd_ = -1;
};

/// Runs `argv` (argv[0] a path) without a shell, in the folder `scratch`
/// (relative paths in `argv` name its files), its stdout and stderr going to
/// the new file `logName` there; killed after `timeoutSeconds`. Empty when
/// it ran and exited 0 in time, else why not ("exit status 1", "killed after
/// 120 s", ...).
std::string runInFolder(const std::vector<std::string> &argv,
                        const ScratchFolder &scratch,
                        const std::string &logName, int timeoutSeconds);

} // namespace dualkv::tools

#endif
