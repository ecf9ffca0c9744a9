// Files the library reads but did not just write (cache entries, the tuning
// database): only the user's own folders are used, only regular files of a
// bounded size are read, every part of an entry is checksummed, and a FIFO,
// a device or a huge sparse file is refused at once.
#include "FakeDriver.h"

#include "cache/Files.h"

#include "dualkv/Tuning.h"

#include <catch2/catch.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>

#include <fcntl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

using namespace dualkv;
using namespace dualkv::testing;
using Catch::Matchers::Contains;
namespace fs = std::filesystem;

namespace {

constexpr uid_t kOtherUid = 65534; // nobody

mode_t modeOf(const std::string &path) {
  struct stat st;
  REQUIRE(::lstat(path.c_str(), &st) == 0);
  return st.st_mode & 07777;
}

/// Runs `body` in a child process limited to `seconds` and 1 GiB of address
/// space: true when it returns true in time (a hang or a runaway allocation
/// fails the check instead of the test run).
bool boundedRun(int seconds, const std::function<bool()> &body) {
  pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    ::alarm(static_cast<unsigned>(seconds));
    struct rlimit limit = {1ul << 30, 1ul << 30};
    ::setrlimit(RLIMIT_AS, &limit);
    bool ok = false;
    try {
      ok = body();
    } catch (...) {
    }
    ::_exit(ok ? 0 : 1);
  }
  int status = 0;
  REQUIRE(::waitpid(pid, &status, 0) == pid);
  return WIFEXITED(status) && WEXITSTATUS(status) == 0;
}

/// A sparse file of `bytes` (no blocks written).
void sparse(const std::string &path, off_t bytes) {
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  REQUIRE(fd >= 0);
  REQUIRE(::ftruncate(fd, bytes) == 0);
  ::close(fd);
}

/// Makes `path` belong to another user (needs root), or says it cannot.
bool giveAway(const std::string &path) {
  return ::geteuid() == 0 && ::lchown(path.c_str(), kOtherUid, kOtherUid) == 0;
}

} // namespace

TEST_CASE("files: only regular files of a bounded size are read", "[files]") {
  TempDir tmp;
  const std::string file = tmp.path + "/f";
  FileRules rules{100, /*noFollow=*/true, /*ownedOnly=*/true};
  // The message of a refusal, or nullopt when `path` is read.
  auto refusal = [](const std::string &path,
                    const FileRules &r) -> std::optional<std::string> {
    llvm::Expected<std::string> bytes = readFileChecked(AT_FDCWD, path, r);
    if (bytes)
      return std::nullopt;
    return takeErrorParts(bytes.takeError()).message;
  };

  writeFile(file, "hello");
  CHECK(valueOf(readFileChecked(AT_FDCWD, file, rules)) == "hello");

  ErrorParts none =
      partsOf(readFileChecked(AT_FDCWD, tmp.path + "/none", rules));
  CHECK(isMissingFile(none));

  writeFile(file, std::string(101, 'x'));
  ErrorParts large = partsOf(readFileChecked(AT_FDCWD, file, rules));
  CHECK_FALSE(isMissingFile(large));
  CHECK(large.code == ErrorCode::InvalidArgument);
  CHECK_THAT(large.message, Contains("101 bytes, more than the 100 allowed"));

  CHECK_THAT(messageOf(readFileChecked(AT_FDCWD, tmp.path, rules)),
             Contains("is a directory, not a regular file"));

  const std::string fifo = tmp.path + "/fifo";
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  CHECK(boundedRun(10, [&] {
    std::optional<std::string> w = refusal(fifo, FileRules{100});
    return w && w->find("is a FIFO, not a regular file") != std::string::npos;
  }));

  const std::string zero = tmp.path + "/zero";
  fs::create_symlink("/dev/zero", zero);
  CHECK_THAT(messageOf(readFileChecked(AT_FDCWD, zero, rules)),
             Contains("symbolic link"));
  // Followed, the link leads to a device: refused without a read.
  CHECK(boundedRun(10, [&] {
    std::optional<std::string> w = refusal(zero, FileRules{1u << 20});
    return w && w->find("character device") != std::string::npos;
  }));

  const std::string huge = tmp.path + "/huge";
  sparse(huge, off_t(4) << 30);
  auto start = std::chrono::steady_clock::now();
  CHECK(boundedRun(
      10, [&] { return refusal(huge, FileRules{64u << 20}).has_value(); }));
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(5));

  writeFile(file, "x");
  ::chmod(file.c_str(), 0666);
  CHECK_THAT(messageOf(readFileChecked(AT_FDCWD, file, rules)),
             Contains("group or others may write it (mode 0666)"));
  ::chmod(file.c_str(), 0600);
  if (giveAway(file))
    CHECK_THAT(messageOf(readFileChecked(AT_FDCWD, file, rules)),
               Contains("belongs to uid 65534"));
}

TEST_CASE("files: JSON nesting is bounded before parsing", "[files]") {
  CHECK_FALSE(jsonNestsDeeperThan(R"([{"a": [1, {"b": "[[[[[["}]}])", 4));
  CHECK(jsonNestsDeeperThan(R"([{"a": [1, {"b": "[[[[[["}]}])", 3));
  CHECK(jsonNestsDeeperThan("[[[[", 3));
  CHECK(jsonNestsDeeperThan(std::string(100000, '[') + std::string(100000, ']'),
                            kMaxJsonDepth));
  // Brackets inside strings, escaped quotes included, do not count.
  CHECK_FALSE(jsonNestsDeeperThan(R"(["\"[[[[[[[["])", 2));
}

TEST_CASE("disk cache: folders are made 0700 and files 0600", "[files]") {
  TempDir tmp;
  const std::string root = tmp.path + "/new/cache";
  DiskCache disk(root);
  requireSuccess(disk.store(sampleKey(), sampleEntry()));
  const std::string dir = disk.entryDir(sampleKey());
  CHECK(modeOf(root) == 0700);
  for (std::string d = dir; d != root; d = fs::path(d).parent_path().string())
    CHECK(modeOf(d) == 0700);
  for (const char *name : {"kernel.ptx", "kernel.cubin", "meta.json"})
    CHECK(modeOf(dir + "/" + name) == 0600);
  CHECK(disk.load(sampleKey()));
}

TEST_CASE("disk cache: a root others can write or do not own is refused",
          "[files]") {
  TempDir tmp;
  const std::string root = tmp.path + "/cache";
  // Every run of a section has a TempDir, so a root of its own (a refusal
  // lasts for the process).
  SECTION("mode 0777") {
    DiskCache good(root);
    requireSuccess(good.store(sampleKey(), sampleEntry()));
    ::chmod(root.c_str(), 0777);
  }
  SECTION("group-writable") {
    fs::create_directory(root);
    ::chmod(root.c_str(), 0770);
  }
  SECTION("owned by another user") {
    fs::create_directory(root);
    ::chmod(root.c_str(), 0755);
    if (!giveAway(root))
      return;
  }
  SECTION("a link to another user's folder") {
    const std::string theirs = tmp.path + "/theirs";
    fs::create_directory(theirs);
    ::chmod(theirs.c_str(), 0755);
    if (!giveAway(theirs))
      return;
    fs::create_symlink(theirs, root);
  }
  SECTION("a folder below the root is a link") {
    const std::string elsewhere = tmp.path + "/elsewhere";
    DiskCache there(elsewhere);
    requireSuccess(there.store(sampleKey(), sampleEntry()));
    fs::create_directory(root);
    ::chmod(root.c_str(), 0700);
    const std::string version = "/v" + std::to_string(CacheKey::kSchemaVersion);
    fs::create_symlink(elsewhere + version, root + version);
  }
  SECTION("an entry folder owned by another user") {
    DiskCache good(root);
    requireSuccess(good.store(sampleKey(), sampleEntry()));
    if (!giveAway(good.entryDir(sampleKey())))
      return;
  }
  DiskCache disk(root);
  CHECK_FALSE(disk.load(sampleKey()));
  CHECK(disk.refused());
  CHECK_THAT(messageOf(disk.store(sampleKey(), sampleEntry())),
             Contains("not in use"));
}

TEST_CASE("disk cache: a link to the user's own folder is a usable root",
          "[files]") {
  TempDir tmp;
  const std::string real = tmp.path + "/real";
  fs::create_directory(real);
  ::chmod(real.c_str(), 0700);
  fs::create_symlink(real, tmp.path + "/link");
  DiskCache disk(tmp.path + "/link");
  requireSuccess(disk.store(sampleKey(), sampleEntry()));
  CHECK(disk.load(sampleKey()));
  CHECK_FALSE(disk.refused());
}

TEST_CASE("disk cache: entry files that are not the user's own regular files "
          "are misses, rewritten by the next store",
          "[files]") {
  TempDir tmp;
  DiskCache disk(tmp.path + "/cache");
  requireSuccess(disk.store(sampleKey(), sampleEntry()));
  const std::string dir = disk.entryDir(sampleKey());

  SECTION("PTX planted by another user") {
    // Same bytes, so every checksum still matches: only the owner is wrong.
    if (!giveAway(dir + "/kernel.ptx"))
      return;
  }
  SECTION("PTX writable by others") {
    ::chmod((dir + "/kernel.ptx").c_str(), 0666);
  }
  SECTION("PTX a link to a file with the same bytes") {
    writeFile(tmp.path + "/copy.ptx", sampleEntry().ptx);
    fs::remove(dir + "/kernel.ptx");
    fs::create_symlink(tmp.path + "/copy.ptx", dir + "/kernel.ptx");
  }
  SECTION("PTX a link to /dev/zero") {
    fs::remove(dir + "/kernel.ptx");
    fs::create_symlink("/dev/zero", dir + "/kernel.ptx");
  }
  SECTION("meta.json a link to /dev/zero") {
    fs::remove(dir + "/meta.json");
    fs::create_symlink("/dev/zero", dir + "/meta.json");
  }
  SECTION("meta.json a FIFO") {
    fs::remove(dir + "/meta.json");
    REQUIRE(::mkfifo((dir + "/meta.json").c_str(), 0600) == 0);
  }
  SECTION("PTX a FIFO") {
    fs::remove(dir + "/kernel.ptx");
    REQUIRE(::mkfifo((dir + "/kernel.ptx").c_str(), 0600) == 0);
  }
  SECTION("cubin a FIFO") {
    fs::remove(dir + "/kernel.cubin");
    REQUIRE(::mkfifo((dir + "/kernel.cubin").c_str(), 0600) == 0);
  }
  SECTION("PTX a 4 GiB sparse file") {
    sparse(dir + "/kernel.ptx", off_t(4) << 30);
  }
  SECTION("meta.json a 4 GiB sparse file") {
    sparse(dir + "/meta.json", off_t(4) << 30);
  }
  SECTION("PTX a folder") {
    fs::remove(dir + "/kernel.ptx");
    fs::create_directory(dir + "/kernel.ptx");
  }
  SECTION("cubin a folder holding files") {
    fs::remove(dir + "/kernel.cubin");
    fs::create_directories(dir + "/kernel.cubin/a/b");
    writeFile(dir + "/kernel.cubin/a/b/x", "x");
  }

  auto start = std::chrono::steady_clock::now();
  CHECK(boundedRun(10, [&] { return !disk.load(sampleKey()); }));
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(5));
  CHECK_FALSE(disk.refused());
  // The store after the recompile replaces the file, whatever is in its
  // place (a folder included), and leaves nothing else behind.
  requireSuccess(disk.store(sampleKey(), sampleEntry()));
  std::optional<CacheEntry> back = disk.load(sampleKey());
  REQUIRE(back);
  CHECK(back->ptx == sampleEntry().ptx);
  CHECK(back->cubin == sampleEntry().cubin);
  std::vector<std::string> names;
  for (const fs::directory_entry &e : fs::directory_iterator(dir)) {
    names.push_back(e.path().filename().string());
    CHECK(fs::is_regular_file(fs::symlink_status(e.path())));
  }
  std::sort(names.begin(), names.end());
  CHECK(names ==
        std::vector<std::string>{"kernel.cubin", "kernel.ptx", "meta.json"});
}

TEST_CASE("disk cache: an entry whose meta.json became a folder is repaired "
          "by the next store, and a second process hits",
          "[files]") {
  TempDir tmp;
  DiskCache disk(tmp.path + "/cache");
  requireSuccess(disk.store(sampleKey(), sampleEntry()));
  const std::string dir = disk.entryDir(sampleKey());
  // The folder holds a file, a folder, and links to a file and a folder of
  // the user's outside the cache: the repair follows neither link.
  const std::string outsideFile = tmp.path + "/keep.txt";
  const std::string outsideDir = tmp.path + "/keep";
  writeFile(outsideFile, "keep");
  fs::create_directory(outsideDir);
  writeFile(outsideDir + "/inner.txt", "keep");
  fs::remove(dir + "/meta.json");
  fs::create_directories(dir + "/meta.json/sub");
  writeFile(dir + "/meta.json/sub/file", "junk");
  fs::create_symlink(outsideFile, dir + "/meta.json/link-to-file");
  fs::create_symlink(outsideDir, dir + "/meta.json/sub/link-to-dir");

  CHECK_FALSE(disk.load(sampleKey())); // a miss, warned about
  // The store after the recompile (as precompile's) replaces the folder.
  requireSuccess(disk.store(sampleKey(), sampleEntry()));
  CHECK(fs::is_regular_file(fs::symlink_status(dir + "/meta.json")));
  // A second process (a new DiskCache, no memory of this one) hits.
  std::optional<CacheEntry> back =
      DiskCache(tmp.path + "/cache").load(sampleKey());
  REQUIRE(back);
  CHECK(back->ptx == sampleEntry().ptx);
  CHECK(back->info.threads == sampleEntry().info.threads);
  // What the links led to is untouched; nothing of the folder is left.
  CHECK(readFile(outsideFile) == "keep");
  CHECK(readFile(outsideDir + "/inner.txt") == "keep");
  std::vector<std::string> names;
  for (const fs::directory_entry &e : fs::directory_iterator(dir))
    names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  CHECK(names ==
        std::vector<std::string>{"kernel.cubin", "kernel.ptx", "meta.json"});
}

TEST_CASE("disk cache: the checksum covers the launch geometry and every "
          "other field of meta.json",
          "[files]") {
  TempDir tmp;
  DiskCache disk(tmp.path);
  requireSuccess(disk.store(sampleKey(), sampleEntry()));
  const std::string metaPath = disk.entryDir(sampleKey()) + "/meta.json";
  const nlohmann::json meta = nlohmann::json::parse(readFile(metaPath));
  REQUIRE(meta.contains("sha256"));

  std::vector<std::pair<const char *, std::function<void(nlohmann::json &)>>>
      edits = {
          {"threads 256 -> 257",
           [](nlohmann::json &m) { m["kernel"]["threads"] = 257; }},
          {"threads 256 -> 128",
           [](nlohmann::json &m) { m["kernel"]["threads"] = 128; }},
          {"shared bytes",
           [](nlohmann::json &m) { m["kernel"]["shared_bytes"] = 0; }},
          {"block_m", [](nlohmann::json &m) { m["kernel"]["block_m"] = 64; }},
          {"entry point",
           [](nlohmann::json &m) { m["kernel"]["name"] = "other"; }},
          {"checksum removed", [](nlohmann::json &m) { m.erase("sha256"); }},
          {"unknown field added", [](nlohmann::json &m) { m["x"] = 1; }},
      };
  for (auto &[what, edit] : edits) {
    INFO(what);
    nlohmann::json changed = meta;
    edit(changed);
    writeFile(metaPath, changed.dump(2));
    CHECK_FALSE(disk.load(sampleKey()));
  }
  writeFile(metaPath, meta.dump(2));
  CHECK(disk.load(sampleKey()));
}

TEST_CASE("disk cache: an entry with an unusable launch shape is a miss",
          "[files]") {
  TempDir tmp;
  DiskCache disk(tmp.path);
  // Stored with a consistent checksum: only the values are wrong.
  for (auto [threads, blockM, shared, name] :
       {std::tuple{-1, 64, 0, "k"}, std::tuple{0, 64, 0, "k"},
        std::tuple{129, 64, 0, "k"}, std::tuple{2048, 64, 0, "k"},
        std::tuple{128, 0, 0, "k"}, std::tuple{128, 64, -4, "k"},
        std::tuple{128, 64, 1 << 30, "k"}, std::tuple{128, 64, 0, ""},
        std::tuple{128, 64, 0, "a b"}}) {
    CacheEntry bad = sampleEntry();
    bad.info = KernelInfo{name, threads, shared, blockM};
    INFO(fmt::format("{} threads, block_m {}, {} B, '{}'", threads, blockM,
                     shared, name));
    requireSuccess(disk.store(sampleKey(), bad));
    CHECK_FALSE(disk.load(sampleKey()));
  }
  requireSuccess(disk.store(sampleKey(), sampleEntry()));
  CHECK(disk.load(sampleKey()));
}

TEST_CASE("tuning: FIFOs, devices, folders, huge and deep files are refused "
          "at once",
          "[files]") {
  TempDir tmp;
  const std::string path = tmp.path + "/tuning.json";
  std::string expected;
  SECTION("FIFO") {
    REQUIRE(::mkfifo(path.c_str(), 0600) == 0);
    expected = "is a FIFO";
  }
  SECTION("link to /dev/zero") {
    fs::create_symlink("/dev/zero", path);
    expected = "is a character device";
  }
  SECTION("folder") {
    fs::create_directory(path);
    expected = "is a directory";
  }
  SECTION("4 GiB sparse file") {
    sparse(path, off_t(4) << 30);
    expected = "more than the";
  }
  SECTION("deeply nested") {
    writeFile(path, std::string(100000, '[') + std::string(100000, ']'));
    expected = "nests deeper than 32 levels";
  }
  SECTION("deep value inside an entry") {
    writeFile(path, R"({"schema": "dualkv-tuning", "version": 2, "entries": )"
                    R"([{"kind": "fwd", "P": )" +
                        std::string(40, '[') + std::string(40, ']') + "}]}");
    expected = "nests deeper than 32 levels";
  }
  CHECK(boundedRun(10, [&] {
    std::string error;
    TuningDb db = TuningDb::load(path, &error);
    return db.entries().empty() && error.find("ignored") != std::string::npos &&
           error.find(expected) != std::string::npos;
  }));
}

TEST_CASE("disk cache: a root that cannot be created is an error with a "
          "reason, not a silent miss",
          "[files]") {
  // sysfs refuses new folders (EPERM), even to root.
  DiskCache disk("/sys/dualkv-test-cache/cache");
  CHECK_THAT(messageOf(disk.store(sampleKey(), sampleEntry())),
             Contains("cannot create /sys/dualkv-test-cache/cache: "));
  CHECK_FALSE(disk.refused());
  CHECK_FALSE(disk.load(sampleKey()));
  // A root below a regular file is no folder of this user's: refused.
  TempDir tmp;
  const std::string file = tmp.path + "/file";
  writeFile(file, "x");
  DiskCache onFile(file + "/cache");
  CHECK_FALSE(messageOf(onFile.store(sampleKey(), sampleEntry())).empty());
  CHECK(onFile.refused());
}
