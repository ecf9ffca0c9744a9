// The on-disk kernel cache, which trusts only what the user owns.
#ifndef DUALKV_RUNTIME_CACHE_DISKCACHE_H
#define DUALKV_RUNTIME_CACHE_DISKCACHE_H

#include "cache/CacheKey.h"
#include "cache/Files.h"
#include "driver/Module.h"

#include <optional>
#include <string>

namespace dualkv {

/// What the compiler produced for one key.
using CacheEntry = KernelImage;

/// The on-disk cache: `<root>/v<schema>/<arch>/<hash>/{kernel.ptx,
/// kernel.cubin, meta.json}`. meta.json holds the key, the KernelInfo, SHA-256
/// sums of the PTX and cubin and a SHA-256 of all of that, so no part of an
/// entry can change unnoticed. Every file is written to a uniquely named temp
/// file in the entry's folder and renamed into place, meta.json last, so
/// readers see a complete entry or none even while several processes store the
/// same key.
///
/// The cache trusts only what the user owns: folders are created 0700 and
/// files 0600; the root (which may be reached through a symbolic link) and
/// every folder below it must belong to the current user with no group or
/// other write permission, and no link is followed below the root. A folder
/// that fails this is reported once and the cache at that root is not used
/// again in this process (kernels are then cached in memory only). A file
/// that is a link, not a regular file, not the user's own, larger than the
/// cap or inconsistent with its checksums makes the entry a miss, rewritten
/// after the recompile.
class DiskCache {
public:
  explicit DiskCache(std::string root);

  /// $DUALKV_CACHE_DIR, else $XDG_CACHE_HOME/dualkv, else ~/.cache/dualkv
  /// ($HOME, else the password database's home); empty when none of them can
  /// be formed (the disk cache is then off). Empty variables are unset and
  /// relative ones invalid (XDG's rule): a relative $XDG_CACHE_HOME is passed
  /// over for $HOME, a relative $HOME leaves no root, a relative
  /// $DUALKV_CACHE_DIR turns the disk cache off with a warning. Every reader of
  /// the root (the default tuning database included) takes it from here.
  static std::string defaultRoot();

  const std::string &root() const { return root_; }
  /// The folder of `key`'s entry.
  std::string entryDir(const CacheKey &key) const;

  /// The entry of `key`, or nullopt on a miss. A damaged entry (bad JSON,
  /// another schema or key, a checksum mismatch, a missing file) is a miss
  /// too, reported on stderr once per process.
  std::optional<CacheEntry> load(const CacheKey &key) const;

  /// Writes `entry` for `key`, replacing what was there. An
  /// InvalidArgument error says why the files cannot be written.
  llvm::Error store(const CacheKey &key, const CacheEntry &entry) const;

  /// Whether this root was refused (not the user's alone) in this process.
  bool refused() const;
  /// False when the root is refused now or was before (reported once); a
  /// root that does not exist yet is usable.
  bool usable() const;

private:
  struct EntryFolder {
    FileDescriptor fd;
    std::string path;
  };
  /// The entry folder of `key`, walked from the root without following links
  /// below it and created (0700) with `create`. An ordinary miss is an error
  /// for which isMissingFile holds; an untrusted folder refuses the root.
  llvm::Expected<EntryFolder> openEntry(const CacheKey &key, bool create) const;
  /// Reports `why` once and stops using this root in this process.
  void refuse(const std::string &why) const;

  std::string root_;
};

/// Writes `bytes` to `name` in the folder `dir` (shown as `shownDir` in
/// messages) so that no reader ever sees a partial file: a 0600 temp file
/// created O_EXCL|O_NOFOLLOW beside it, every write checked, then renameat(2)
/// over `name` (a link there is replaced, never followed). On failure the
/// temp file is removed and `name` is untouched.
llvm::Error writeAtomically(int dir, const std::string &shownDir,
                            const std::string &name, llvm::StringRef bytes);

} // namespace dualkv

#endif
