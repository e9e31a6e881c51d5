// Stand-in Metal declarations so g++ can syntax-check kernel sources.
//
// Catches: C++ syntax errors, undeclared names, wrong argument counts and
// types against these declarations, template instantiation errors with the
// template values the Python wrapper really passes.
// Does not catch: Metal address-space rules (device/threadgroup/constant are
// erased here), Metal-only builtins beyond those declared below, barrier
// placement and uniform control flow, numerical behaviour, or anything about
// how MLX generates the kernel signature beyond what test_kernels.py mimics.
#pragma once
#include <cmath>
#include <cstddef>
#include <cstdint>

#define device
#define threadgroup
#define constant
#define thread

using uint = unsigned int;
using ushort = unsigned short;
using uchar = unsigned char;

struct uint3 {
  uint x, y, z;
};

struct half {
  float v;
  half() : v(0) {}
  half(float f) : v(f) {}
  operator float() const { return v; }
};

struct bfloat16_t {
  float v;
  bfloat16_t() : v(0) {}
  bfloat16_t(float f) : v(f) {}
  operator float() const { return v; }
};

namespace metal {
inline float exp(float x) { return std::exp(x); }
inline float log(float x) { return std::log(x); }
template <typename T> inline T max(T a, T b) { return a > b ? a : b; }
template <typename T> inline T min(T a, T b) { return a < b ? a : b; }
}  // namespace metal

enum class mem_flags { mem_none, mem_device, mem_threadgroup };
void threadgroup_barrier(mem_flags);

template <typename T> T simd_sum(T);
template <typename T> T simd_max(T);
template <typename T> T simd_shuffle_down(T, ushort);
template <typename T> T simd_shuffle_xor(T, ushort);
template <typename To, typename From> To as_type(From);
