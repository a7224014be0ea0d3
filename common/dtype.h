// Element types and on-the-fly conversion between FLOAT32, BFLOAT16 and
// FLOAT16. Pure functions; safe from any thread.
#ifndef WEIGHTSYNC_COMMON_DTYPE_H_
#define WEIGHTSYNC_COMMON_DTYPE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "weightsync/v1/types.pb.h"

namespace weightsync {

using v1::DType;

// Bytes per element, or 0 for DTYPE_UNSPECIFIED / unknown values.
int64_t ElementSize(DType dtype);

// "bfloat16", "float32", ... for messages.
std::string DTypeName(DType dtype);

// True for FLOAT32, BFLOAT16 and FLOAT16.
bool IsConvertibleFloat(DType dtype);

// True if bytes of `src` can be installed into memory of `dst`: equal types,
// or both convertible floats.
bool CanConvert(DType src, DType dst);

// Element count of `shape`, or an error naming `what` for a negative
// dimension or a byte size that would overflow.
absl::StatusOr<int64_t> NumElements(const std::vector<int64_t>& shape,
                                    DType dtype, const std::string& what);

// "[4096, 1024]".
std::string ShapeString(const std::vector<int64_t>& shape);

// Converts `n` elements from `src` (of type `from`) to `dst` (of type `to`).
// Equal types are a memcpy. Requires CanConvert(from, to). Rounding is
// round-to-nearest-even; NaN stays NaN.
void ConvertElements(const void* src, DType from, void* dst, DType to,
                     int64_t n);

// Scalar helpers (exposed for tests).
uint16_t FloatToBf16(float f);
float Bf16ToFloat(uint16_t h);
uint16_t FloatToHalf(float f);
float HalfToFloat(uint16_t h);

}  // namespace weightsync

#endif  // WEIGHTSYNC_COMMON_DTYPE_H_
