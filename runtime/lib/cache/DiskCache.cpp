// The on-disk kernel cache, which trusts only what the user owns.
#include "cache/DiskCache.h"

#include "support/Env.h"
#include "support/Status.h"

#include "dualkv/Bounded.h"

#include <fmt/format.h>
#include <llvm/ADT/SmallString.h>
#include <llvm/Support/FileSystem.h>
#include <llvm/Support/Path.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <limits>
#include <mutex>
#include <random>
#include <set>
#include <system_error>
#include <vector>

#include <dirent.h>
#include <fcntl.h>
#include <pwd.h>
#include <sys/stat.h>
#include <unistd.h>

namespace dualkv {

using nlohmann::json;

namespace {

/// The most bytes a cache file may have: a kernel's PTX or cubin is well
/// under a megabyte; meta.json is a few hundred bytes.
constexpr size_t kMaxKernelFileBytes = 64u << 20;
constexpr size_t kMaxMetaBytes = 1u << 20;

/// A cache folder opened for use, or why not. `untrusted` marks a folder that
/// is not this user's alone (or not a folder at all): the whole disk cache is
/// then refused, since anything written there could be replaced by others.
struct OpenedDir {
  FileDescriptor fd;
  bool missing = false;
  bool untrusted = false;
  std::string why;
};

/// Opens the folder `name` inside `parent` (a path when `parent` is
/// AT_FDCWD); only the cache root may be reached through a symbolic link (the
/// folder it names is checked). With `create`, a missing folder is made 0700.
OpenedDir openCacheDir(int parent, const std::string &name,
                       const std::string &shown, bool isRoot, bool create) {
  OpenedDir r;
  const int flags = O_RDONLY | O_DIRECTORY | O_CLOEXEC |
                    (isRoot ? 0 : static_cast<int>(O_NOFOLLOW));
  r.fd = FileDescriptor(::openat(parent, name.c_str(), flags));
  std::string createError;
  if (!r.fd && errno == ENOENT && create) {
    if (isRoot) {
      if (std::error_code ec = llvm::sys::fs::create_directories(
              name, /*IgnoreExisting=*/true, llvm::sys::fs::owner_all))
        createError = ec.message();
    } else if (::mkdirat(parent, name.c_str(), 0700) != 0 && errno != EEXIST) {
      createError = std::strerror(errno);
    }
    r.fd = FileDescriptor(::openat(parent, name.c_str(), flags));
  }
  if (!r.fd && !createError.empty()) {
    // A read-only or full file system: an error, not a miss.
    r.why = fmt::format("cannot create {}: {}", shown, createError);
    return r;
  }
  if (!r.fd) {
    int err = errno;
    r.missing = err == ENOENT;
    r.untrusted = err == ELOOP || err == ENOTDIR;
    r.why = r.untrusted
                ? fmt::format("{} is not a folder (a symbolic link or a file)",
                              shown)
                : fmt::format("cannot open {}: {}", shown, std::strerror(err));
    return r;
  }
  struct stat st;
  if (::fstat(r.fd.get(), &st) != 0) {
    r.why = fmt::format("cannot examine {}: {}", shown, std::strerror(errno));
    r.fd = FileDescriptor();
    return r;
  }
  if (llvm::Error untrusted = checkTrusted(st.st_uid, st.st_mode)) {
    r.untrusted = true;
    r.why = fmt::format("{}: {}", shown, llvm::toString(std::move(untrusted)));
    r.fd = FileDescriptor();
  }
  return r;
}

/// How deep removeTree descends into a folder that took a file's place;
/// what lies deeper stays (under a name no reader opens).
constexpr int kMaxRemoveDepth = 16;

/// Removes `name` in the folder `dir` and, for a folder, everything in it,
/// opening nothing through a symbolic link (a link is removed, never what it
/// leads to). Best effort: used only inside an entry folder the cache has
/// checked is the user's alone.
void removeTree(int dir, const std::string &name, int depth) {
  if (::unlinkat(dir, name.c_str(), 0) == 0 ||
      (errno != EISDIR && errno != EPERM))
    return;
  if (depth >= kMaxRemoveDepth)
    return;
  int fd = ::openat(dir, name.c_str(),
                    O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0)
    return;
  DIR *folder = ::fdopendir(fd);
  if (!folder) {
    ::close(fd);
    return;
  }
  std::vector<std::string> names;
  while (const struct dirent *e = ::readdir(folder))
    if (std::strcmp(e->d_name, ".") != 0 && std::strcmp(e->d_name, "..") != 0)
      names.emplace_back(e->d_name);
  for (const std::string &n : names)
    removeTree(::dirfd(folder), n, depth + 1);
  ::closedir(folder);
  ::unlinkat(dir, name.c_str(), AT_REMOVEDIR);
}

/// Moves the folder `name` in `dir` to a name of its own in `dir`, then
/// removes it (removeTree). A writer racing this one may have renamed a file
/// into place meanwhile: that file is moved and removed the same way, and
/// each writer then renames its own copy in.
void moveAsideAndRemove(int dir, const std::string &name) {
  static std::atomic<uint64_t> counter{0};
  static const uint64_t salt = std::random_device{}();
  const std::string aside =
      fmt::format("{}.damaged.{}.{:x}", name, ::getpid(),
                  salt ^ (counter++ * 0x9E3779B97F4A7C15ull));
  if (::renameat(dir, name.c_str(), dir, aside.c_str()) == 0)
    removeTree(dir, aside, 0);
}

/// Roots refused in this process: each is reported once, then left alone.
struct RefusedRoots {
  std::mutex mutex;
  std::set<std::string> roots;
};
RefusedRoots &refusedRoots() {
  static RefusedRoots refused;
  return refused;
}

/// The checksum of a meta.json: SHA-256 of its canonical JSON without the
/// checksum field itself, so that it covers the key, the launch geometry and
/// (through their own sums) the PTX and cubin.
std::string entryChecksum(json meta) {
  meta.erase("sha256");
  return sha256Hex(meta.dump());
}

std::string joinPath(llvm::StringRef a, llvm::StringRef b) {
  llvm::SmallString<256> path(a);
  llvm::sys::path::append(path, b);
  return path.str().str();
}

/// This user's home folder from the password database (where $HOME is
/// unset or empty), or nothing.
std::optional<std::string> passwdHome() {
  long size = ::sysconf(_SC_GETPW_R_SIZE_MAX);
  std::vector<char> buffer(size > 0 ? static_cast<size_t>(size) : 16384);
  struct passwd entry, *found = nullptr;
  if (::getpwuid_r(::geteuid(), &entry, buffer.data(), buffer.size(), &found) !=
          0 ||
      !found || !found->pw_dir || !*found->pw_dir)
    return std::nullopt;
  return std::string(found->pw_dir);
}

} // namespace

// Writes `bytes` to `name` in the folder `dir` so that no reader ever sees a
// partial file: a 0600 temp file unique to this process and call (pid plus
// random characters, so threads and ranks never share one) in the same
// folder, then renameat(2), which is atomic and replaces whatever `name` was
// (a damaged file, a link, a FIFO; a folder is moved aside and removed
// first).
llvm::Error writeAtomically(int dir, const std::string &shownDir,
                            const std::string &name, llvm::StringRef bytes) {
  static std::atomic<uint64_t> counter{0};
  static const uint64_t salt = std::random_device{}();
  std::string tmp;
  FileDescriptor fd;
  for (int attempt = 0; attempt < 100 && !fd; ++attempt) {
    tmp = fmt::format("{}.tmp.{}.{:x}", name, ::getpid(),
                      salt ^ (counter++ * 0x9E3779B97F4A7C15ull));
    fd = FileDescriptor(
        ::openat(dir, tmp.c_str(),
                 O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600));
    if (!fd && errno != EEXIST)
      break;
  }
  if (!fd)
    return invalidArgument(fmt::format("cannot create a temp file in {}: {}",
                                       shownDir, std::strerror(errno)));
  const char *at = bytes.data();
  size_t left = bytes.size();
  while (left > 0) {
    ssize_t n = ::write(fd.get(), at, left);
    if (n < 0 && errno == EINTR)
      continue;
    if (n <= 0) {
      llvm::Error error =
          invalidArgument(fmt::format("cannot write {}/{}: {}", shownDir, tmp,
                                      std::strerror(n < 0 ? errno : EIO)));
      ::unlinkat(dir, tmp.c_str(), 0);
      return error;
    }
    at += n;
    left -= static_cast<size_t>(n);
  }
  bool renamed = ::close(fd.release()) == 0 &&
                 ::renameat(dir, tmp.c_str(), dir, name.c_str()) == 0;
  if (!renamed && (errno == EISDIR || errno == ENOTEMPTY || errno == EEXIST)) {
    // A folder where the file belongs (a damaged entry): rename(2) replaces
    // no folder with a file, so it is moved aside, then removed.
    moveAsideAndRemove(dir, name);
    renamed = ::renameat(dir, tmp.c_str(), dir, name.c_str()) == 0;
  }
  if (!renamed) {
    llvm::Error error = invalidArgument(fmt::format(
        "cannot write {}/{}: {}", shownDir, name, std::strerror(errno)));
    ::unlinkat(dir, tmp.c_str(), 0);
    return error;
  }
  return llvm::Error::success();
}

DiskCache::DiskCache(std::string root) : root_(std::move(root)) {}

std::string DiskCache::defaultRoot() {
  // Each variable is read as the XDG base directory spec reads its own: empty
  // is unset, and a relative path is invalid (it would follow the working
  // folder: `XDG_CACHE_HOME=` once put the cache at ./dualkv).
  auto absolute = [](const std::optional<std::string> &dir) {
    return dir && llvm::sys::path::is_absolute(*dir);
  };
  if (std::optional<std::string> dir = env("DUALKV_CACHE_DIR")) {
    if (absolute(dir))
      return *dir;
    // An explicit choice is not swapped for another folder.
    warnOnce(fmt::format("DUALKV_CACHE_DIR '{}' is not an absolute path; "
                         "kernels are cached in memory only",
                         clipForMessage(*dir, 256)));
    return {};
  }
  if (std::optional<std::string> xdg = env("XDG_CACHE_HOME"); absolute(xdg))
    return joinPath(*xdg, "dualkv");
  std::optional<std::string> home = env("HOME");
  if (!home)
    home = passwdHome();
  if (!absolute(home))
    return {};
  return joinPath(joinPath(*home, ".cache"), "dualkv");
}

std::string DiskCache::entryDir(const CacheKey &key) const {
  llvm::SmallString<256> path(root_);
  llvm::sys::path::append(path, fmt::format("v{}", CacheKey::kSchemaVersion),
                          key.arch, key.hash());
  return path.str().str();
}

void DiskCache::refuse(const std::string &why) const {
  RefusedRoots &r = refusedRoots();
  {
    std::lock_guard<std::mutex> lock(r.mutex);
    r.roots.insert(root_);
  }
  warnOnce(fmt::format("the kernel cache {} is not used: {}; kernels are "
                       "cached in memory only",
                       root_, why));
}

bool DiskCache::usable() const {
  if (root_.empty() || refused())
    return false;
  OpenedDir dir = openCacheDir(AT_FDCWD, root_, root_, /*isRoot=*/true,
                               /*create=*/false);
  if (dir.untrusted)
    refuse(dir.why);
  return !dir.untrusted;
}

bool DiskCache::refused() const {
  RefusedRoots &r = refusedRoots();
  std::lock_guard<std::mutex> lock(r.mutex);
  return r.roots.count(root_) != 0;
}

llvm::Expected<DiskCache::EntryFolder> DiskCache::openEntry(const CacheKey &key,
                                                            bool create) const {
  if (root_.empty() || refused())
    return invalidArgument(
        fmt::format("the kernel cache {} is not in use", root_));
  if (!isIdentifier(key.arch))
    return invalidArgument(
        fmt::format("arch '{}' cannot name a cache folder", key.arch));
  OpenedDir dir = openCacheDir(AT_FDCWD, root_, root_, /*isRoot=*/true, create);
  std::string shown = root_;
  for (const std::string &name :
       {fmt::format("v{}", CacheKey::kSchemaVersion), key.arch, key.hash()}) {
    if (!dir.fd)
      break;
    shown = joinPath(shown, name);
    dir = openCacheDir(dir.fd.get(), name, shown, /*isRoot=*/false, create);
  }
  if (dir.untrusted)
    refuse(dir.why);
  if (!dir.fd)
    return makeError(
        ErrorCode::InvalidArgument, dir.why,
        dir.missing ? std::make_error_code(std::errc::no_such_file_or_directory)
                    : std::error_code());
  return EntryFolder{std::move(dir.fd), shown};
}

std::optional<CacheEntry> DiskCache::load(const CacheKey &key) const {
  llvm::Expected<EntryFolder> folder = openEntry(key, /*create=*/false);
  if (!folder) {
    ErrorParts why = takeErrorParts(folder.takeError());
    if (!isMissingFile(why) && !refused())
      warnOnce(fmt::format("cannot read the kernel cache: {}", why.message));
    return std::nullopt; // an ordinary miss says nothing
  }
  const std::string &dir = folder->path;
  const int fd = folder->fd.get();

  auto damaged = [&](const std::string &why) -> std::optional<CacheEntry> {
    warnOnce(fmt::format("cache entry {} is unusable ({}): treated as a miss",
                         dir, why));
    return std::nullopt;
  };
  // Files are read without following links, only when they are this user's
  // regular files of a bounded size; anything else is a damaged entry, which
  // the store after the recompile replaces.
  auto read = [&](const char *name, size_t maxBytes) {
    return readFileChecked(
        fd, name, FileRules{maxBytes, /*noFollow=*/true, /*ownedOnly=*/true});
  };

  llvm::Expected<std::string> metaText = read("meta.json", kMaxMetaBytes);
  if (!metaText) {
    ErrorParts why = takeErrorParts(metaText.takeError());
    if (isMissingFile(why))
      return std::nullopt; // an ordinary miss: say nothing
    return damaged(why.message);
  }
  if (jsonNestsDeeperThan(*metaText, kMaxJsonDepth))
    return damaged("meta.json nests too deeply");
  json meta = json::parse(*metaText, nullptr, /*allow_exceptions=*/false);
  if (!meta.is_object())
    return damaged("meta.json is not a JSON object");

  CacheEntry entry;
  std::string ptxSum, cubinSum;
  // Every field typed: integers are JSON integers that fit an int (128.9,
  // 1e300 and 2^32 + 128 are no thread counts), then the launch shape is
  // ranged (checkLaunchShape). A checksum only proves who wrote the values.
  auto integer = [](const json &v) -> std::optional<int> {
    std::optional<int64_t> value = jsonInteger(
        v, std::numeric_limits<int>::min(), std::numeric_limits<int>::max());
    return value ? std::optional<int>(static_cast<int>(*value)) : std::nullopt;
  };
  auto badField = [&](const char *field, const json &v) {
    return damaged(fmt::format("meta.json's {} {} is not a 32-bit integer",
                               field, clipForMessage(v.dump(), 80)));
  };
  try {
    if (!meta.contains("sha256") || !meta["sha256"].is_string())
      return damaged("meta.json has no entry checksum");
    if (meta["sha256"].get<std::string>() != entryChecksum(meta))
      return damaged("meta.json does not match its checksum");
    std::optional<int> schema = integer(meta.at("schema"));
    if (schema != CacheKey::kSchemaVersion)
      return damaged(fmt::format("schema version {} is not {}",
                                 clipForMessage(meta.at("schema").dump(), 80),
                                 CacheKey::kSchemaVersion));
    if (meta.at("key") != key.toJson())
      return damaged("meta.json describes another key");
    const json &kernel = meta.at("kernel");
    if (!kernel.at("name").is_string())
      return damaged("meta.json's kernel.name is not a string");
    entry.info.name = kernel.at("name").get<std::string>();
    struct Field {
      const char *name, *shown;
      int &out;
    };
    for (const Field &f :
         {Field{"threads", "kernel.threads", entry.info.threads},
          Field{"shared_bytes", "kernel.shared_bytes", entry.info.sharedBytes},
          Field{"block_m", "kernel.block_m", entry.info.blockM}}) {
      std::optional<int> value = integer(kernel.at(f.name));
      if (!value)
        return badField(f.shown, kernel.at(f.name));
      f.out = *value;
    }
    if (!meta.at("ptx_sha256").is_string())
      return damaged("meta.json's ptx_sha256 is not a string");
    ptxSum = meta.at("ptx_sha256").get<std::string>();
    if (!meta.at("cubin_sha256").is_null()) {
      if (!meta.at("cubin_sha256").is_string())
        return damaged("meta.json's cubin_sha256 is neither null nor a string");
      cubinSum = meta.at("cubin_sha256").get<std::string>();
    }
  } catch (const json::exception &e) {
    return damaged(fmt::format("meta.json is malformed: {}", e.what()));
  }
  if (llvm::Error bad = checkLaunchShape(entry.info))
    return damaged(llvm::toString(std::move(bad)));

  llvm::Expected<std::string> ptx = read("kernel.ptx", kMaxKernelFileBytes);
  if (!ptx)
    return damaged(llvm::toString(ptx.takeError()));
  if (sha256Hex(*ptx) != ptxSum)
    return damaged("kernel.ptx does not match its checksum");
  entry.ptx = std::move(*ptx);

  if (!cubinSum.empty()) {
    llvm::Expected<std::string> cubin =
        read("kernel.cubin", kMaxKernelFileBytes);
    if (!cubin)
      return damaged(llvm::toString(cubin.takeError()));
    if (sha256Hex(*cubin) != cubinSum)
      return damaged("kernel.cubin does not match its checksum");
    entry.cubin.assign(cubin->begin(), cubin->end());
  }
  return entry;
}

llvm::Error DiskCache::store(const CacheKey &key,
                             const CacheEntry &entry) const {
  llvm::Expected<EntryFolder> folder = openEntry(key, /*create=*/true);
  if (!folder)
    return folder.takeError();
  const std::string &dir = folder->path;
  const int fd = folder->fd.get();
  llvm::StringRef cubin(entry.cubin.data(), entry.cubin.size());
  json meta = {
      {"schema", CacheKey::kSchemaVersion},
      {"key", key.toJson()},
      {"kernel",
       {{"name", entry.info.name},
        {"threads", entry.info.threads},
        {"shared_bytes", entry.info.sharedBytes},
        {"block_m", entry.info.blockM}}},
      {"ptx_sha256", sha256Hex(entry.ptx)},
      {"cubin_sha256", cubin.empty() ? json(nullptr) : json(sha256Hex(cubin))},
  };
  meta["sha256"] = entryChecksum(meta);
  // meta.json goes last: it is what makes the entry visible to load(), and
  // its checksums catch a reader that interleaves with a writer whose output
  // differs from ours.
  if (llvm::Error e = writeAtomically(fd, dir, "kernel.ptx", entry.ptx))
    return e;
  if (!cubin.empty())
    if (llvm::Error e = writeAtomically(fd, dir, "kernel.cubin", cubin))
      return e;
  return writeAtomically(fd, dir, "meta.json", meta.dump(2) + "\n");
}

} // namespace dualkv
