// The arithmetic of the receipt and sparse-patch kernels
// (receipt_kernels.cu, sparse_kernels.cu), as plain inline functions that
// nvcc compiles for the GPU and a C++ compiler for the CPU. The CPU test
// (kernel_math_test) runs the very code each GPU thread runs, thread by
// thread, against the daemon's own references (ComputeReceipt,
// ApplySparsePatch), so the index and tiling math is proven without a GPU.
//
// Plain C++17, no CUDA headers needed: includable from any .cc file.
#ifndef WEIGHTSYNC_BACKENDS_CUDA_KERNEL_MATH_H_
#define WEIGHTSYNC_BACKENDS_CUDA_KERNEL_MATH_H_

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define WS_HD __host__ __device__ __forceinline__
#else
#define WS_HD inline
#endif

namespace weightsync {
namespace cuda {

// ---------------------------------------------------------------------------
// Receipts (docs/protocol.md, "Receipts"; common/checksum.h).

// common/checksum.h's function (v3), in 32-bit operations only: a GPU has
// no 64-bit multiplier (it emulates one with several 32-bit ones), so
// these keep the kernel bound by memory, not by the SMs' integer units.
constexpr uint32_t kKeyLo = 0x9E3779B1u;   // kReceiptIndexLo
constexpr uint32_t kKeyHi = 0x85EBCA77u;   // kReceiptIndexHi
constexpr uint32_t kBitsHi = 0x27D4EB2Fu;  // kReceiptBitsHi
constexpr uint32_t kMix = 0x85EBCA6Bu;     // kReceiptMix

// Salt32: the 32-bit salt from ParameterSalt's 64 bits.
WS_HD uint32_t SaltOf(uint64_t salt) {
  return static_cast<uint32_t>(salt) ^ static_cast<uint32_t>(salt >> 32);
}

// ReceiptKey(s, index).
WS_HD uint32_t KeyOf(uint32_t s, uint64_t index) {
  return s + static_cast<uint32_t>(index) * kKeyLo +
         static_cast<uint32_t>(index >> 32) * kKeyHi;
}

// Mix32: one multiply and two xorshifts per element.
WS_HD uint32_t Mix32(uint32_t x) {
  x ^= x >> 16;
  const uint32_t y = x * kMix;
  return y ^ (y >> 16);
}

// ElementTerm given the element's key and its Bits32.
WS_HD uint32_t TermOf(uint32_t key, uint32_t bits32) {
  return Mix32(bits32 ^ key);
}

// One 2-D run of a parameter's installed elements, e.g. one segment of it:
// rows x cols elements of `es` bytes; row r starts at
// base + r * row_stride_bytes; element (r, c) is element
//   first_index + r * (row_stride_bytes / es) + c
// of the parameter (its flat, row-major element number). Its terms are added
// (mod 2^64) to *out.
//
// For segment s of parameter p (daemon/core/receipt.cc):
//   base = region + p.offset + s.dest_offset * es, first_index =
//   s.dest_offset, rows = s.row_count, cols = s.col_count,
//   row_stride_bytes = s.dest_row_stride * es, salt = ParameterSalt(p.name).
struct ReceiptRegion {
  // Set by the caller.
  const void* base;
  int64_t rows;
  int64_t cols;
  int64_t row_stride_bytes;
  uint64_t salt;
  uint64_t first_index;
  unsigned long long* out;  // device memory; receives atomicAdd
  // Optional: a copy region. Every element read at base is also written to
  // dst (row r at dst + r * dst_row_stride_bytes), and element (r, c) is
  // element first_index + r * (dst_row_stride_bytes / es) + c: the terms are
  // keyed on where the element is written (the receipt of an IPC copy fused
  // with it, GpuWorker::PlanFusedCopies). nullptr: base is only read, and
  // a non-zero dst_row_stride_bytes then only sets the index's row stride
  // (a trainer's expectation reads its checkpoint tensor with the
  // checkpoint's row stride and keys each element on its place in the
  // engine: ExpectedReceiptRegions).
  void* dst;
  int64_t dst_row_stride_bytes;
  int32_t es;  // 1, 2, 4 or 8

  // Set by PlanReceiptRegions (rows, cols and row_stride_bytes may be
  // rewritten too: contiguous rows are merged into one).
  int32_t rows_per_tile;     // > 1: a tile is that many whole rows
  int64_t chunks_per_row;    // tiles along one row when rows_per_tile == 1
  int64_t index_row_stride;  // (dst_)row_stride_bytes / es
  int64_t tile_begin;        // first tile of this region in the batch
  int64_t tiles;             // tiles of this region
};
// Copied byte for byte from the host to device memory: one layout for both.
static_assert(sizeof(ReceiptRegion) == 112, "ReceiptRegion layout");

// A block of kReceiptThreads threads takes one tile at a time: up to
// kReceiptTileBytes of one row (each thread kReceiptUnroll 16-byte vectors
// plus at most one head and one tail element), or several whole narrow rows
// (element by element).
constexpr int kReceiptThreads = 256;
constexpr int kReceiptUnroll = 4;
constexpr int64_t kReceiptTileBytes = int64_t{kReceiptThreads} * 16 * 4;

// Validates `r` and fills its layout fields, its tiles starting at
// `tile_begin`. False (and `r` unusable) where: es is not 1, 2, 4 or 8;
// rows or cols < 0; for a non-empty region: base or out null, base not a
// multiple of es, and, with rows > 1, row_stride_bytes not a multiple of es
// or shorter than a row (cols * es). A copy region (dst set) also needs dst
// and its stride to meet the same rules, and the source and destination
// equally misaligned modulo 16 bytes on every row (16-byte vectors are read
// and written at the same offsets).
inline bool PlanReceiptRegion(ReceiptRegion& r, int64_t tile_begin) {
  if (r.es != 1 && r.es != 2 && r.es != 4 && r.es != 8) return false;
  if (r.rows < 0 || r.cols < 0) return false;
  r.tile_begin = tile_begin;
  r.tiles = 0;
  r.rows_per_tile = 1;
  r.chunks_per_row = 1;
  r.index_row_stride = 0;
  if (r.rows == 0 || r.cols == 0) return true;
  if (r.base == nullptr || r.out == nullptr) return false;
  if (reinterpret_cast<uintptr_t>(r.base) % r.es != 0) return false;
  constexpr int64_t kMax = int64_t{1} << 60;
  if (r.cols > kMax / 8 || r.rows > kMax / 8) return false;
  if (r.rows > 1) {
    if (r.row_stride_bytes % r.es != 0 || r.row_stride_bytes < r.cols * r.es ||
        r.row_stride_bytes > kMax / r.rows) {
      return false;
    }
  }
  const bool copy = r.dst != nullptr;
  const bool second = copy || r.dst_row_stride_bytes != 0;  // a 2nd stride
  if (second) {
    if (copy && reinterpret_cast<uintptr_t>(r.dst) % r.es != 0) return false;
    if (r.rows > 1 && (r.dst_row_stride_bytes % r.es != 0 ||
                       r.dst_row_stride_bytes < r.cols * r.es ||
                       r.dst_row_stride_bytes > kMax / r.rows)) {
      return false;
    }
  }
  if (r.rows > 1 && r.row_stride_bytes == r.cols * r.es &&
      (!second || r.dst_row_stride_bytes == r.cols * r.es)) {
    r.cols *= r.rows;  // contiguous: one long row
    r.rows = 1;
  }
  if (r.rows == 1) {
    r.row_stride_bytes = r.cols * r.es;
    r.dst_row_stride_bytes = second ? r.cols * r.es : 0;
  }
  if (copy && ((reinterpret_cast<uintptr_t>(r.base) -
                reinterpret_cast<uintptr_t>(r.dst)) %
                       16 !=
                   0 ||
               (r.row_stride_bytes - r.dst_row_stride_bytes) % 16 != 0)) {
    return false;
  }
  r.index_row_stride =
      (second ? r.dst_row_stride_bytes : r.row_stride_bytes) / r.es;
  const int64_t te = kReceiptTileBytes / r.es;  // elements per tile
  r.chunks_per_row = (r.cols + te - 1) / te;
  if (r.chunks_per_row == 1 && r.rows > 1 && te / r.cols > 1) {
    r.rows_per_tile = static_cast<int32_t>(te / r.cols);
    r.tiles = (r.rows + r.rows_per_tile - 1) / r.rows_per_tile;
  } else {
    r.tiles = r.rows * r.chunks_per_row;
  }
  return true;
}

// Plans a batch: regions[i] gets tiles [tile_begin, tile_begin + tiles),
// in order. Returns the total number of tiles, or -1 - i when regions[i] is
// invalid (PlanReceiptRegion).
inline int64_t PlanReceiptRegions(ReceiptRegion* regions, int64_t n) {
  int64_t total = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (!PlanReceiptRegion(regions[i], total)) return -1 - i;
    total += regions[i].tiles;
  }
  return total;
}

// The tiles block b of `grid` blocks takes: [*lo, *hi), contiguous, so that
// it meets each region's tiles in a row and adds its partial sum to a
// region's `out` once, not once per tile. Tiles hold equal bytes (but a
// region's last), so the split is even.
WS_HD void ReceiptBlockTiles(int64_t total_tiles, int64_t grid, int64_t b,
                             int64_t* lo, int64_t* hi) {
  *lo = total_tiles * b / grid;
  *hi = total_tiles * (b + 1) / grid;
}

// The region holding tile `t` (< the batch's total) of `n` planned regions
// (regions[i].tile_begin for i < n; a pointer or an indexable wrapper): the
// last one starting at or before t. Empty regions start where the next one
// does, so they are passed over.
template <typename Regions>
WS_HD int64_t FindReceiptRegion(Regions regions, int64_t n, int64_t t) {
  int64_t a = 0, b = n;
  while (b - a > 1) {
    const int64_t mid = a + (b - a) / 2;
    if (regions[mid].tile_begin <= t) {
      a = mid;
    } else {
      b = mid;
    }
  }
  return a;
}

// 16 bytes as four little-endian words.
struct alignas(16) Words4 {
  uint32_t w[4];
};

WS_HD Words4 Load16(const char* p) {
#if defined(__CUDA_ARCH__)
  // Read once, never again by this kernel: don't keep it in the caches.
  const uint4 v = __ldcs(reinterpret_cast<const uint4*>(p));
  Words4 out;
  out.w[0] = v.x;
  out.w[1] = v.y;
  out.w[2] = v.z;
  out.w[3] = v.w;
  return out;
#else
  Words4 out;
  std::memcpy(out.w, p, 16);
  return out;
#endif
}

// Bits32 of one element of ES bytes at `p` (aligned to ES).
template <int ES>
WS_HD uint32_t LoadBits(const char* p) {
#if defined(__CUDA_ARCH__)
  if constexpr (ES == 1) {
    return *reinterpret_cast<const uint8_t*>(p);
  } else if constexpr (ES == 2) {
    return *reinterpret_cast<const uint16_t*>(p);
  } else if constexpr (ES == 4) {
    return *reinterpret_cast<const uint32_t*>(p);
  } else {
    const uint2 v = *reinterpret_cast<const uint2*>(p);
    return v.x ^ v.y * kBitsHi;
  }
#else
  if constexpr (ES == 8) {
    uint32_t w[2];
    std::memcpy(w, p, 8);
    return w[0] ^ w[1] * kBitsHi;
  } else {
    uint32_t bits = 0;
    std::memcpy(&bits, p, ES);
    return bits;
  }
#endif
}

// Bits32 of element j of a 16-byte vector of ES-byte elements.
template <int ES>
WS_HD uint32_t VecBits(const Words4& v, int j) {
  if constexpr (ES == 1) {
    return (v.w[j >> 2] >> (8 * (j & 3))) & 0xFFu;
  } else if constexpr (ES == 2) {
    return (v.w[j >> 1] >> (16 * (j & 1))) & 0xFFFFu;
  } else if constexpr (ES == 4) {
    return v.w[j];
  } else {
    return v.w[2 * j] ^ v.w[2 * j + 1] * kBitsHi;
  }
}

// Sum of the terms of the 16 / ES elements of `v`, the first being element
// `index` of the parameter whose 32-bit salt is `s`.
template <int ES>
WS_HD uint64_t VecTerms(uint32_t s, uint64_t index, const Words4& v) {
  constexpr int kV = 16 / ES;
  const uint32_t key = KeyOf(s, index);
  uint64_t sum = 0;
  if (static_cast<uint32_t>(index) <= 0xFFFFFFFFu - (kV - 1)) {
    // lo32(index) does not wrap within the vector: the keys step by kKeyLo
    // (constants once unrolled), one add per element.
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
    for (int j = 0; j < kV; ++j) {
      sum += TermOf(key + static_cast<uint32_t>(j) * kKeyLo, VecBits<ES>(v, j));
    }
  } else {
    for (int j = 0; j < kV; ++j) {
      sum += TermOf(KeyOf(s, index + j), VecBits<ES>(v, j));
    }
  }
  return sum;
}

WS_HD void Store16(char* p, const Words4& v) {
#if defined(__CUDA_ARCH__)
  // Written once, read by the engine later: don't keep it in the caches.
  __stcs(reinterpret_cast<uint4*>(p),
         make_uint4(v.w[0], v.w[1], v.w[2], v.w[3]));
#else
  std::memcpy(p, v.w, 16);
#endif
}

// Copies one element of ES bytes (both pointers aligned to ES).
template <int ES>
WS_HD void CopyElement(char* dst, const char* src) {
#if defined(__CUDA_ARCH__)
  if constexpr (ES == 1) {
    *reinterpret_cast<uint8_t*>(dst) = *reinterpret_cast<const uint8_t*>(src);
  } else if constexpr (ES == 2) {
    *reinterpret_cast<uint16_t*>(dst) = *reinterpret_cast<const uint16_t*>(src);
  } else if constexpr (ES == 4) {
    *reinterpret_cast<uint32_t*>(dst) = *reinterpret_cast<const uint32_t*>(src);
  } else {
    *reinterpret_cast<uint2*>(dst) = *reinterpret_cast<const uint2*>(src);
  }
#else
  std::memcpy(dst, src, ES);
#endif
}

// What thread `tid` (0 <= tid < kReceiptThreads) adds for tile `t` (0 <= t
// < r.tiles) of planned region `r`: the tiles' threads together cover every
// element of the region exactly once. COPY (r.dst set): each element the
// thread reads it also writes to its place at r.dst.
template <int ES, bool COPY = false>
WS_HD uint64_t ReceiptTileThreadSum(const ReceiptRegion& r, int64_t t,
                                    int tid) {
  constexpr int64_t kTe = kReceiptTileBytes / ES;  // elements per tile
  constexpr int kV = 16 / ES;                      // elements per vector
  const char* base = static_cast<const char*>(r.base);
  const uint32_t s = SaltOf(r.salt);
  uint64_t sum = 0;
  if (r.rows_per_tile > 1) {
    // Whole narrow rows, element by element (at most kTe elements, so
    // 32-bit division).
    const int64_t r0 = t * r.rows_per_tile;
    const int64_t nr =
        r.rows - r0 < r.rows_per_tile ? r.rows - r0 : r.rows_per_tile;
    const uint32_t cols = static_cast<uint32_t>(r.cols);
    const uint32_t n = static_cast<uint32_t>(nr) * cols;
    for (uint32_t e = tid; e < n; e += kReceiptThreads) {
      const uint32_t rr = e / cols;
      const uint32_t c = e - rr * cols;
      const int64_t row = r0 + rr;
      const char* from = base + row * r.row_stride_bytes + int64_t{c} * ES;
      const uint32_t bits = LoadBits<ES>(from);
      if (COPY) {
        CopyElement<ES>(static_cast<char*>(r.dst) +
                            row * r.dst_row_stride_bytes + int64_t{c} * ES,
                        from);
      }
      const uint64_t index = r.first_index +
                             static_cast<uint64_t>(row) *
                                 static_cast<uint64_t>(r.index_row_stride) +
                             c;
      sum += TermOf(KeyOf(s, index), bits);
    }
    return sum;
  }
  // Up to kTe elements of one row: a scalar head up to the first 16-byte
  // boundary, 16-byte vectors, a scalar tail.
  const int64_t row = t / r.chunks_per_row;
  const int64_t c0 = (t - row * r.chunks_per_row) * kTe;
  const int64_t n = r.cols - c0 < kTe ? r.cols - c0 : kTe;
  const char* p = base + row * r.row_stride_bytes + c0 * ES;
  // The destination of p (COPY), equally aligned modulo 16.
  char* q =
      COPY ? static_cast<char*>(r.dst) + row * r.dst_row_stride_bytes + c0 * ES
           : nullptr;
  const uint64_t index0 =
      r.first_index +
      static_cast<uint64_t>(row) * static_cast<uint64_t>(r.index_row_stride) +
      static_cast<uint64_t>(c0);
  int64_t head = ((16 - (reinterpret_cast<uintptr_t>(p) & 15)) & 15) / ES;
  if (head > n) head = n;
  const int64_t nvec = (n - head) / kV;
  const int64_t tail0 = head + nvec * kV;
  if (tid < head) {
    sum += TermOf(KeyOf(s, index0 + tid), LoadBits<ES>(p + tid * ES));
    if (COPY) CopyElement<ES>(q + tid * ES, p + tid * ES);
  }
  if (tid < n - tail0) {
    const int64_t e = tail0 + tid;
    sum += TermOf(KeyOf(s, index0 + e), LoadBits<ES>(p + e * ES));
    if (COPY) CopyElement<ES>(q + e * ES, p + e * ES);
  }
  const char* body = p + head * ES;
  Words4 in[kReceiptUnroll];
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int k = 0; k < kReceiptUnroll; ++k) {
    const int64_t v = tid + k * kReceiptThreads;
    if (v < nvec) in[k] = Load16(body + v * 16);
  }
  if (COPY) {
    char* out = q + head * ES;
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
    for (int k = 0; k < kReceiptUnroll; ++k) {
      const int64_t v = tid + k * kReceiptThreads;
      if (v < nvec) Store16(out + v * 16, in[k]);
    }
  }
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int k = 0; k < kReceiptUnroll; ++k) {
    const int64_t v = tid + k * kReceiptThreads;
    if (v < nvec) {
      sum += VecTerms<ES>(s, index0 + head + v * kV, in[k]);
    }
  }
  return sum;
}

// ---------------------------------------------------------------------------
// Sparse patches (docs/protocol.md, "Sparse patches"; the host's
// ApplySparsePatch in backends/host/host_data_plane.cc).

// One use of a patched checkpoint tensor: daemon/core/copy_plan.h's
// SparsePatch::Use with the parameter's address resolved.
struct SparseUse {
  void* param;    // the parameter's element 0 (region base + param_offset)
  int dtype;      // the parameter's weightsync::v1::DType value
  bool implicit;  // true: the flat index is the parameter element
  int64_t row_begin, row_count, col_begin, col_count;
  int64_t dest_offset, dest_row_stride;  // elements
};
static_assert(sizeof(SparseUse) == 64, "SparseUse layout");

// Where the patch value at flat checkpoint index `index` goes in the
// parameter of use `u`, for a tensor whose 2-D view has `cols` columns and
// `numel` elements: false when it goes nowhere (the index lies outside the
// tensor or outside the use's block), else true with the parameter element
// in *dst. The same arithmetic as ApplySparsePatch.
WS_HD bool SparseDestination(const SparseUse& u, int64_t cols, int64_t numel,
                             int64_t index, int64_t* dst) {
  if (index < 0 || index >= numel) return false;
  if (u.implicit) {
    *dst = index;
    return true;
  }
  const int64_t r = index / cols;
  const int64_t c = index - r * cols;
  if (r < u.row_begin || r >= u.row_begin + u.row_count || c < u.col_begin ||
      c >= u.col_begin + u.col_count) {
    return false;
  }
  *dst =
      u.dest_offset + (r - u.row_begin) * u.dest_row_stride + (c - u.col_begin);
  return true;
}

// Whether entry k of a patch's `indices` (nnz of them) is written at all:
// of a run of equal adjacent indices only the last is, so that the result
// equals the host's sequential loop, where the last one wins. (Equal
// indices that are not adjacent race on the GPU; SparseCheckIndices counts
// them as "unsorted".)
// I: the indices' type (int64_t, or uint32_t for 4-byte indices).
template <typename I>
WS_HD bool SparseEntryWins(const I* indices, int64_t nnz, int64_t k) {
  return k + 1 >= nnz || indices[k + 1] != indices[k];
}

// ---------------------------------------------------------------------------
// The diff helper (sparse_kernels.h, DiffChanged): tiles of
// kDiffThreads x kDiffRounds vectors of 16 bytes.

constexpr int kDiffThreads = 256;
constexpr int kDiffRounds = 8;

WS_HD int64_t DiffTileElems(int es) {
  return int64_t{kDiffThreads} * kDiffRounds * (16 / es);
}

inline int64_t DiffTiles(int64_t numel, int es) {
  const int64_t te = DiffTileElems(es);
  return (numel + te - 1) / te;
}

}  // namespace cuda
}  // namespace weightsync

#endif  // WEIGHTSYNC_BACKENDS_CUDA_KERNEL_MATH_H_
