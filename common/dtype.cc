#include "common/dtype.h"

#include <cmath>
#include <cstring>
#include <limits>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "glog/logging.h"

namespace weightsync {

int64_t ElementSize(DType dtype) {
  switch (dtype) {
    case v1::FLOAT32:
    case v1::INT32:
      return 4;
    case v1::BFLOAT16:
    case v1::FLOAT16:
    case v1::INT16:
      return 2;
    case v1::FLOAT64:
    case v1::INT64:
      return 8;
    case v1::INT8:
    case v1::UINT8:
    case v1::BOOL:
    case v1::FLOAT8_E4M3FN:
    case v1::FLOAT8_E5M2:
      return 1;
    default:
      return 0;
  }
}

std::string DTypeName(DType dtype) {
  switch (dtype) {
    case v1::FLOAT32:
      return "float32";
    case v1::BFLOAT16:
      return "bfloat16";
    case v1::FLOAT16:
      return "float16";
    case v1::FLOAT64:
      return "float64";
    case v1::INT64:
      return "int64";
    case v1::INT32:
      return "int32";
    case v1::INT16:
      return "int16";
    case v1::INT8:
      return "int8";
    case v1::UINT8:
      return "uint8";
    case v1::BOOL:
      return "bool";
    case v1::FLOAT8_E4M3FN:
      return "float8_e4m3fn";
    case v1::FLOAT8_E5M2:
      return "float8_e5m2";
    default:
      return absl::StrCat("dtype(", static_cast<int>(dtype), ")");
  }
}

bool IsConvertibleFloat(DType dtype) {
  return dtype == v1::FLOAT32 || dtype == v1::BFLOAT16 || dtype == v1::FLOAT16;
}

bool CanConvert(DType src, DType dst) {
  if (ElementSize(src) == 0 || ElementSize(dst) == 0) return false;
  return src == dst || (IsConvertibleFloat(src) && IsConvertibleFloat(dst));
}

absl::StatusOr<int64_t> NumElements(const std::vector<int64_t>& shape,
                                    DType dtype, const std::string& what) {
  const int64_t esize = ElementSize(dtype);
  if (esize == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": unknown dtype ", DTypeName(dtype)));
  }
  // Bound the byte size by 2^62 so offsets and sums never overflow.
  constexpr int64_t kMaxBytes = int64_t{1} << 62;
  int64_t n = 1;
  for (int64_t d : shape) {
    if (d < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, ": negative dimension in shape ", ShapeString(shape)));
    }
    if (d != 0 && n > kMaxBytes / esize / d) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": shape ", ShapeString(shape), " is too large"));
    }
    n *= d;
  }
  return n;
}

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

uint16_t FloatToBf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if (std::isnan(f)) return static_cast<uint16_t>((bits >> 16) | 0x40);
  const uint32_t rounding = 0x7FFF + ((bits >> 16) & 1);
  return static_cast<uint16_t>((bits + rounding) >> 16);
}

float Bf16ToFloat(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t FloatToHalf(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000;
  x &= 0x7FFFFFFF;
  if (x >= 0x7F800000) {  // Inf or NaN
    return static_cast<uint16_t>(sign | 0x7C00 | (x > 0x7F800000 ? 0x200 : 0));
  }
  if (x >= 0x477FF000) return static_cast<uint16_t>(sign | 0x7C00);  // overflow
  if (x < 0x38800000) {  // subnormal or zero in half
    if (x < 0x33000000) return static_cast<uint16_t>(sign);  // rounds to 0
    const uint32_t exp = x >> 23;
    const uint32_t mant = (x & 0x7FFFFF) | 0x800000;
    const uint32_t shift = 126 - exp;  // 14..24
    uint32_t h = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1);
    const uint32_t half = 1u << (shift - 1);
    if (rem > half || (rem == half && (h & 1))) ++h;
    return static_cast<uint16_t>(sign | h);
  }
  // Normal: rebias exponent (127 -> 15), round mantissa 23 -> 10 bits.
  uint32_t h = ((x - 0x38000000) >> 13);
  const uint32_t rem = x & 0x1FFF;
  if (rem > 0x1000 || (rem == 0x1000 && (h & 1))) ++h;
  return static_cast<uint16_t>(sign | h);
}

float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1F;
  uint32_t mant = h & 0x3FF;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      exp = 127 - 15 + 1;
      while ((mant & 0x400) == 0) {
        mant <<= 1;
        --exp;
      }
      mant &= 0x3FF;
      bits = sign | (exp << 23) | (mant << 13);
    }
  } else if (exp == 0x1F) {
    bits = sign | 0x7F800000 | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

namespace {

template <typename Load, typename Store>
void ConvertLoop(const uint8_t* src, int64_t src_size, uint8_t* dst,
                 int64_t dst_size, int64_t n, Load load, Store store) {
  for (int64_t i = 0; i < n; ++i) {
    store(dst + i * dst_size, load(src + i * src_size));
  }
}

float LoadAsFloat(const uint8_t* p, DType t) {
  if (t == v1::FLOAT32) {
    float f;
    std::memcpy(&f, p, 4);
    return f;
  }
  uint16_t h;
  std::memcpy(&h, p, 2);
  return t == v1::BFLOAT16 ? Bf16ToFloat(h) : HalfToFloat(h);
}

void StoreFromFloat(uint8_t* p, DType t, float f) {
  if (t == v1::FLOAT32) {
    std::memcpy(p, &f, 4);
    return;
  }
  const uint16_t h = t == v1::BFLOAT16 ? FloatToBf16(f) : FloatToHalf(f);
  std::memcpy(p, &h, 2);
}

}  // namespace

void ConvertElements(const void* src, DType from, void* dst, DType to,
                     int64_t n) {
  CHECK(CanConvert(from, to)) << DTypeName(from) << " -> " << DTypeName(to);
  if (from == to) {
    std::memcpy(dst, src, static_cast<size_t>(n * ElementSize(from)));
    return;
  }
  ConvertLoop(
      static_cast<const uint8_t*>(src), ElementSize(from),
      static_cast<uint8_t*>(dst), ElementSize(to), n,
      [from](const uint8_t* p) { return LoadAsFloat(p, from); },
      [to](uint8_t* p, float f) { StoreFromFloat(p, to, f); });
}

}  // namespace weightsync
