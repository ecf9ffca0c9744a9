// This process's compiles, shared by every thread that asks for a key, and
// the lookup order of a kernel's image: AOT, this process, disk, compiler.
#ifndef DUALKV_RUNTIME_CACHE_COMPILETABLE_H
#define DUALKV_RUNTIME_CACHE_COMPILETABLE_H

#include "cache/DiskCache.h"

#include <string>

namespace dualkv {

/// The compiler's fingerprint (compilerFingerprint()), computed once.
const std::string &fingerprint();

/// Whether this process has compiled `hash`, or is compiling it.
bool compileKnown(const std::string &hash);

/// Keeps `entry` (read from disk for `hash`) in the compile table, so that
/// the launches after a precompile take it without reading the disk again.
void rememberEntry(const std::string &hash, const CacheEntry &entry);

/// The compiled entry of `key` (`spec` resolved): joins a compile of the same
/// key already under way or done in this process, else compiles it here
/// (IR dumped to $DUALKV_DUMP_IR if set) and stores it in `disk` when given.
/// A Compile error when the compiler fails. *compiledHere (if given) says
/// whether this call compiled, rather than joined another's compile.
llvm::Expected<CacheEntry> compileOnce(const KernelSpec &spec,
                                       const CacheKey &key,
                                       const std::string &hash,
                                       const DiskCache *disk,
                                       bool *compiledHere = nullptr);

/// Where an entry came from.
enum class Origin { Aot, Memory, Disk, Compiled };

/// The entry of `spec` (resolved; `key` and `hash` its): the AOT registry,
/// this process's compiles (joining one under way), the disk cache (unless
/// DUALKV_ALWAYS_COMPILE=1), else a compile stored on disk. Counts what it
/// does in the cache stats; a Compile error when the compiler fails.
llvm::Expected<CacheEntry> findOrCompile(const KernelSpec &spec,
                                         const CacheKey &key,
                                         const std::string &hash,
                                         Origin *origin = nullptr);

/// Empties the compile table (clearKernelCache). A failed compile is
/// forgotten by itself, so that a later request retries it.
void forgetCompiles();

} // namespace dualkv

#endif
