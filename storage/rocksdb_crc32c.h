// Hardware CRC32C for librocksdb (internal to storage/).
//
// RocksDB checksums everything it writes with CRC32C (rocksdb::crc32c::Extend):
// every blob record of every row, every SST block. The Debian librocksdb 7.8
// is built without its SSE4.2 code path (`objdump -d` finds no crc32
// instruction in it), so it computes CRC32C one table lookup per byte: in
// `aqswarm bench store` that was ~37% of the whole process's CPU, almost all
// of it in RocksDB's flush threads writing blob files (perf, 128x768 rows).
//
// rocksdb_crc32c.cc defines rocksdb::crc32c::Extend -- the exact function the
// library exports and calls through its PLT -- in our binaries, so the
// dynamic linker binds RocksDB's calls to it (ELF symbol interposition, the
// mechanism that lets a program replace malloc). It computes the same
// CRC32C (Castagnoli, same pre/post inversion) with the SSE4.2 crc32
// instruction, three independent streams at a time; on a CPU without SSE4.2
// it forwards to the library's own implementation. RocksDB is unchanged:
// same files, same checksums, verified the same way. Tests compare it with
// the library's implementation (LibraryCrc32cExtend) on many lengths and
// alignments.
//
// Where the library is linked with -Bsymbolic or calls the function
// internally without the PLT, the override is simply not used (and
// Crc32cOverrideBound() says so); nothing else changes.
#ifndef AQSWARM_STORAGE_ROCKSDB_CRC32C_H_
#define AQSWARM_STORAGE_ROCKSDB_CRC32C_H_

#include <cstddef>
#include <cstdint>

namespace aqswarm::storage::internal {

// CRC32C continued from `crc` (the value of a previous call; 0 to start) over
// `data[0, n)`: what rocksdb::crc32c::Extend computes, with SSE4.2 where the
// CPU has it.
uint32_t Crc32cExtend(uint32_t crc, const char* data, size_t n);

// Whether Crc32cExtend uses the crc32 instruction (the CPU has SSE4.2).
bool Crc32cIsHardware();

// librocksdb's own rocksdb::crc32c::Extend (looked up past our override);
// nullptr if the library does not export it. For tests.
using Crc32cExtendFn = uint32_t (*)(uint32_t, const char*, size_t);
Crc32cExtendFn LibraryCrc32cExtend();

// Whether calls to rocksdb::crc32c::Extend made through the dynamic linker
// (as librocksdb makes them) reach our override.
bool Crc32cOverrideBound();

}  // namespace aqswarm::storage::internal

#endif  // AQSWARM_STORAGE_ROCKSDB_CRC32C_H_
