// Zero-copy page gather (CLO, arXiv 2511.14510, §4): pages of a page-locked host buffer,
// mapped into the device's address space, read by the device itself and written into a
// device buffer — no copy engine, no host thread. Page `p` is `words` words starting at
// word `src_off[p]` of `src` and goes to word `dst_off[p]` of `dst`. One thread per word,
// grid-stride, so consecutive threads read consecutive words of a page (coalesced reads
// over the link).
#include <stdint.h>

template <typename W>
__device__ void gather(const W* __restrict__ src, W* __restrict__ dst,
                       const unsigned long long* __restrict__ src_off,
                       const unsigned long long* __restrict__ dst_off,
                       unsigned int pages, unsigned int words) {
  const unsigned long long n = (unsigned long long)pages * words;
  for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (unsigned long long)gridDim.x * blockDim.x) {
    const unsigned long long p = i / words;
    const unsigned long long w = i - p * words;
    dst[dst_off[p] + w] = src[src_off[p] + w];
  }
}

// 16-byte words: pages and offsets aligned to 16 bytes.
extern "C" __global__ void kvpolicy_gather_pages_16(const uint4* src, uint4* dst,
                                                    const unsigned long long* src_off,
                                                    const unsigned long long* dst_off,
                                                    unsigned int pages, unsigned int words) {
  gather(src, dst, src_off, dst_off, pages, words);
}

// 4-byte words: any page of f32, f16 or bf16 with an even element count.
extern "C" __global__ void kvpolicy_gather_pages_4(const uint32_t* src, uint32_t* dst,
                                                   const unsigned long long* src_off,
                                                   const unsigned long long* dst_off,
                                                   unsigned int pages, unsigned int words) {
  gather(src, dst, src_off, dst_off, pages, words);
}
