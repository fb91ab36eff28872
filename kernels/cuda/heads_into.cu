// heads_into: rows (b, t, heads*d), contiguous, written as heads into a strided
// destination (b, heads, t, d), rotated on the way by trig (t, d): cos | sin
// (rotation 0: copy, 1: halves, as HF Llama, 2: interleaved pairs, as GGUF).
// One thread per destination element; arithmetic in f32, as the CPU reference.
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <stdint.h>

template <typename T> __device__ __forceinline__ float to_f(T v);
template <> __device__ __forceinline__ float to_f<float>(float v) { return v; }
template <> __device__ __forceinline__ float to_f<__half>(__half v) { return __half2float(v); }
template <> __device__ __forceinline__ float to_f<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T> __device__ __forceinline__ T of_f(float v);
template <> __device__ __forceinline__ float of_f<float>(float v) { return v; }
template <> __device__ __forceinline__ __half of_f<__half>(float v) { return __float2half(v); }
template <> __device__ __forceinline__ __nv_bfloat16 of_f<__nv_bfloat16>(float v) { return __float2bfloat16(v); }

template <typename T>
__device__ void heads_into(const T *rows, const T *trig, T *dst,
                           size_t b, size_t t, size_t heads, size_t d,
                           size_t s0, size_t s1, size_t s2, size_t s3, int rotation) {
  size_t n = b * t * heads * d;
  for (size_t e = blockIdx.x * blockDim.x + threadIdx.x; e < n; e += (size_t)blockDim.x * gridDim.x) {
    // e walks the rows' order: ((bi * t + ti) * heads + hi) * d + i.
    size_t i = e % d;
    size_t hi = (e / d) % heads;
    size_t ti = (e / (d * heads)) % t;
    size_t bi = e / (d * heads * t);
    const T *src = rows + ((bi * t + ti) * heads + hi) * d;
    float v;
    if (rotation == 0) {
      v = to_f(src[i]);
    } else {
      size_t half = d / 2;
      size_t j, a, c;
      bool first;
      if (rotation == 1) {
        j = i % half; first = i < half; a = j; c = j + half;
      } else {
        j = i / 2; first = (i % 2) == 0; a = 2 * j; c = 2 * j + 1;
      }
      float co = to_f(trig[ti * d + j]), si = to_f(trig[ti * d + half + j]);
      float x1 = to_f(src[a]), x2 = to_f(src[c]);
      v = first ? x1 * co - x2 * si : x1 * si + x2 * co;
    }
    dst[bi * s0 + hi * s1 + ti * s2 + i * s3] = of_f<T>(v);
  }
}

#define HEADS_INTO(NAME, T)                                                              \
  extern "C" __global__ void NAME(const T *rows, const T *trig, T *dst,                  \
                                  size_t b, size_t t, size_t heads, size_t d, size_t s0, \
                                  size_t s1, size_t s2, size_t s3, int rotation) {       \
    heads_into<T>(rows, trig, dst, b, t, heads, d, s0, s1, s2, s3, rotation);             \
  }

HEADS_INTO(heads_into_f32, float)
HEADS_INTO(heads_into_f16, __half)
HEADS_INTO(heads_into_bf16, __nv_bfloat16)
