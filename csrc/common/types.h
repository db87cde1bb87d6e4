// Torch-free scalar types shared by CPU kernels and the binding layer.
#pragma once
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

namespace tk {

// Must match tempokern/_ops/common.py::DTYPE_CODES.
enum class DType : int { F32 = 0, F16 = 1, BF16 = 2, F64 = 3 };

inline DType to_dtype(int code) {
  if (code < 0 || code > 3) throw std::invalid_argument("tempokern: unknown dtype code " + std::to_string(code));
  return static_cast<DType>(code);
}

// Storage types for CPU code; arithmetic always happens in float/double.
struct half_t { uint16_t x; };
struct bf16_t { uint16_t x; };

inline float half_to_float(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f, mant = h & 0x3ff, bits;
  if (exp == 0) {
    if (mant == 0) { bits = sign; }
    else {  // subnormal: renormalise
      exp = 127 - 15 + 1;
      while (!(mant & 0x400)) { mant <<= 1; --exp; }
      mant &= 0x3ff;
      bits = sign | (exp << 23) | (mant << 13);
    }
  } else if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f; std::memcpy(&f, &bits, 4); return f;
}

inline uint16_t float_to_half(float f) {  // round to nearest even
  uint32_t x; std::memcpy(&x, &f, 4);
  uint32_t sign = (x >> 16) & 0x8000;
  uint32_t absx = x & 0x7fffffffu;
  if (absx >= 0x7f800000u) return (uint16_t)(sign | 0x7c00 | (absx > 0x7f800000u ? 0x200 : 0));
  if (absx >= 0x477ff000u) return (uint16_t)(sign | 0x7c00);  // overflow -> inf
  if (absx < 0x38800000u) {  // subnormal or zero in half
    if (absx < 0x33000000u) return (uint16_t)sign;
    uint32_t e = absx >> 23, m = (absx & 0x7fffff) | 0x800000;
    uint32_t shift = 126 - e;  // 113 + 13
    uint32_t r = m >> shift, rem = m & ((1u << shift) - 1), halfway = 1u << (shift - 1);
    if (rem > halfway || (rem == halfway && (r & 1))) ++r;
    return (uint16_t)(sign | r);
  }
  uint32_t r = ((absx >> 13) - ((127 - 15) << 10));
  uint32_t rem = absx & 0x1fff;
  if (rem > 0x1000 || (rem == 0x1000 && (r & 1))) ++r;
  return (uint16_t)(sign | r);
}

inline float bf16_to_float(uint16_t h) { uint32_t b = (uint32_t)h << 16; float f; std::memcpy(&f, &b, 4); return f; }
inline uint16_t float_to_bf16(float f) {
  uint32_t x; std::memcpy(&x, &f, 4);
  if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40);  // quiet NaN
  x += 0x7fffu + ((x >> 16) & 1);
  return (uint16_t)(x >> 16);
}

template <typename T> struct Acc { using type = float; };
template <> struct Acc<double> { using type = double; };

template <typename T> inline typename Acc<T>::type load(const T* p, int64_t i) { return p[i]; }
template <> inline float load<half_t>(const half_t* p, int64_t i) { return half_to_float(p[i].x); }
template <> inline float load<bf16_t>(const bf16_t* p, int64_t i) { return bf16_to_float(p[i].x); }

template <typename T, typename A> inline void store(T* p, int64_t i, A v) { p[i] = (T)v; }
template <> inline void store<half_t, float>(half_t* p, int64_t i, float v) { p[i].x = float_to_half(v); }
template <> inline void store<bf16_t, float>(bf16_t* p, int64_t i, float v) { p[i].x = float_to_bf16(v); }

// Calls f(T{}) with the storage type matching a dtype code.
template <typename F> inline void dispatch_float(DType dt, F&& f) {
  switch (dt) {
    case DType::F32: f(float{}); break;
    case DType::F64: f(double{}); break;
    case DType::F16: f(half_t{}); break;
    case DType::BF16: f(bf16_t{}); break;
  }
}

[[noreturn]] inline void fail(const std::string& msg) { throw std::invalid_argument("tempokern: " + msg); }

}  // namespace tk
