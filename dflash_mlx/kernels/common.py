"""What Metal and CUDA kernel sources share: one body per kernel, two preludes.

A kernel body is written once against the macros below (SHARED declares
threadgroup/shared memory, SHARED_PTR qualifies a pointer to it, DEV a device
pointer); each backend adds a
short prologue that reads its own thread indices (MLX finds Metal's thread
attributes by name in the source, so those must stay out of headers).
"""

METAL_PRELUDE = """
#define DEV device
#define SHARED threadgroup
#define SHARED_PTR threadgroup
#define DEVICE_FN inline
#define BARRIER() threadgroup_barrier(mem_flags::mem_threadgroup)
#define WARP_SUM(v) simd_sum(v)
#define WARP_MAX(v) simd_max(v)
#define SHFL_DOWN(v, off) simd_shuffle_down(v, off)
#define EXP(x) metal::exp(x)
#define LOG(x) metal::log(x)
#define FMAX(a, b) metal::max(a, b)
#define IMIN(a, b) metal::min(a, b)
#define AS_UINT(f) as_type<unsigned int>(f)
#define AS_FLOAT(u) as_type<float>(u)
#define ISINF(x) metal::isinf(x)
// MLX's LogSumExp kernels (mlx/backend/metal/kernels/logsumexp.h): fast::exp,
// 4 reads per thread, a one-pass block kernel up to 4096 columns.
#define FAST_EXP(x) metal::fast::exp(x)
#define LSE_READS(T) 4
#define LSE_BLOCK_LIMIT 4096
#define FINITE_MAX 3.40282347e+38f
"""

CUDA_PRELUDE = """
#define DEV
#define SHARED __shared__
#define SHARED_PTR
#define DEVICE_FN __device__ inline
#define BARRIER() __syncthreads()
#define SHFL_DOWN(v, off) __shfl_down_sync(0xffffffffu, v, off)
#define EXP(x) expf(x)
#define LOG(x) logf(x)
#define FMAX(a, b) fmaxf(a, b)
#define IMIN(a, b) min(a, b)
#define AS_UINT(f) __float_as_uint(f)
#define AS_FLOAT(u) __uint_as_float(u)
#define ISINF(x) isinf(x)
// MLX's LogSumExp kernel (mlx/backend/cuda/logsumexp.cu): __expf, 16 bytes
// read per thread, always the looped (online) form.
#define FAST_EXP(x) __expf(x)
#define LSE_READS(T) (16 / (int)sizeof(T))
#define LSE_BLOCK_LIMIT 0
#define FINITE_MAX 3.40282347e+38f

__device__ inline float WARP_SUM(float v) {
  for (int off = 16; off > 0; off /= 2) { v += __shfl_xor_sync(0xffffffffu, v, off); }
  return v;
}

__device__ inline float WARP_MAX(float v) {
  for (int off = 16; off > 0; off /= 2) { v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off)); }
  return v;
}
"""

PRELUDE = {"metal": METAL_PRELUDE, "cuda": CUDA_PRELUDE}

# Threadgroup-wide reductions: every thread gets the result.
REDUCTIONS = """
DEVICE_FN float block_sum(float v, SHARED_PTR float* red, int lane, int wid, int nw) {
  v = WARP_SUM(v);
  BARRIER();
  if (lane == 0) { red[wid] = v; }
  BARRIER();
  v = lane < nw ? red[lane] : 0.0f;
  return WARP_SUM(v);
}

DEVICE_FN float block_max(float v, SHARED_PTR float* red, int lane, int wid, int nw) {
  v = WARP_MAX(v);
  BARRIER();
  if (lane == 0) { red[wid] = v; }
  BARRIER();
  v = lane < nw ? red[lane] : -INFINITY;
  return WARP_MAX(v);
}

// Order-preserving map between float and unsigned int, for bisection over floats.
DEVICE_FN unsigned int fkey(float f) {
  unsigned int u = AS_UINT(f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

DEVICE_FN float funkey(unsigned int k) {
  return AS_FLOAT((k & 0x80000000u) ? (k ^ 0x80000000u) : ~k);
}
"""

# One threadgroup (block) of 1-D threads per row.
ROW_PROLOGUE = {
    "metal": """
  int row = threadgroup_position_in_grid.x;
  int tid = thread_position_in_threadgroup.x;
  int tgs = threads_per_threadgroup.x;
  int lane = thread_index_in_simdgroup;
  int wid = simdgroup_index_in_threadgroup;
""",
    "cuda": """
  int row = blockIdx.x;
  int tid = threadIdx.x;
  int tgs = blockDim.x;
  int lane = tid & 31;
  int wid = tid >> 5;
""",
}
