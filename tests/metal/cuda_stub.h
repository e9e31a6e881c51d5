// Stand-in CUDA declarations so g++ can syntax-check the CUDA twins, wrapped
// the way MLX's mx.fast.cuda_kernel wraps a source (see test_kernels.py).
//
// Catches: C++ syntax errors, undeclared names, type errors against these
// declarations, with the template constants the Python wrapper passes.
// Does not catch: device/host rules, shared-memory and warp semantics,
// anything nvrtc or MLX's own device headers would reject or define
// differently, and numerical behaviour.
#pragma once
#include <math.h>
#include <algorithm>
#include <cstddef>
#include <cstdint>

#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static

struct dim3 {
  unsigned int x, y, z;
};
extern dim3 threadIdx, blockIdx, blockDim, gridDim;

struct __half {
  float v;
  __half(float f = 0) : v(f) {}
  operator float() const { return v; }
};

struct __nv_bfloat16 {
  float v;
  __nv_bfloat16(float f = 0) : v(f) {}
  operator float() const { return v; }
};

using std::max;
using std::min;

void __syncthreads();
template <typename T> T __shfl_xor_sync(unsigned int, T, int, int width = 32);
template <typename T> T __shfl_down_sync(unsigned int, T, unsigned int, int width = 32);
unsigned int __float_as_uint(float);
float __uint_as_float(unsigned int);

namespace cooperative_groups {}
