// CRC-32 (zlib's: IEEE 802.3, reflected) of each row of bytes, one thread block per row: what a
// store lists for each row, computed next to fp8 codes on the GPU (hscapture/consumer/device_fp8.py).
//
// Each of the 256 threads takes the "raw" CRC (register from zero, no final xor) of a contiguous
// piece of its row with a byte table; neighbours are then combined in a tree, the left one moved
// over the right one's length (a product with x^(8 * length) modulo the polynomial, as zlib's
// crc32_combine does). Raw CRCs are linear, so the row's is the xor of its pieces' moved ones;
// zlib's CRC is that xor the CRC of as many zero bytes (``zero_crc``, given by the host).
// Compiled at run time with NVRTC (cupy.RawModule); device_fp8.py falls back to
// hscapture.consumer.device_fp8.RowCrcs (torch kernels) where it cannot.

#define THREADS 256
#define POLY 0xEDB88320u

__device__ __forceinline__ unsigned int multmodp(unsigned int a, unsigned int b) {   // a x b modulo POLY
    unsigned int m = 1u << 31, p = 0;
    for (;;) {
        if (a & m) {
            p ^= b;
            if ((a & (m - 1)) == 0) break;
        }
        m >>= 1;
        b = b & 1 ? (b >> 1) ^ POLY : b >> 1;
    }
    return p;
}

// x^(2^k) modulo POLY, k = 0..31: zlib's x2n_table (constants, so no block recomputes them).
__constant__ unsigned int X2N[32] = {
    0x40000000u, 0x20000000u, 0x08000000u, 0x00800000u, 0x00008000u, 0xedb88320u,
    0xb1e6b092u, 0xa06a2517u, 0xed627daeu, 0x88d14467u, 0xd7bbfe6au, 0xec447f11u,
    0x8e7ea170u, 0x6427800eu, 0x4d47bae0u, 0x09fe548fu, 0x83852d0fu, 0x30362f1au,
    0x7b5a9cc3u, 0x31fec169u, 0x9fec022au, 0x6c8dedc4u, 0x15d6874du, 0x5fde7a4eu,
    0xbad90e37u, 0x2e4e5eefu, 0x4eaba214u, 0xa8a472c0u, 0x429a969eu, 0x148d302au,
    0xc40ba6d0u, 0xc4e22c3cu,
};

// Row blockIdx.x of block blockIdx.y (e.g. of a tensor): bytes at rows + y * block_stride + x * row_stride,
// its CRC at out[y * out_stride + x].
extern "C" __global__ void crc32_rows(const unsigned char* rows, long long row_stride, long long block_stride,
                                      int width, unsigned int* out, int out_stride, unsigned int zero_crc) {
    __shared__ unsigned int table[256];      // raw CRC of each byte value
    __shared__ unsigned int crcs[THREADS];
    __shared__ int lengths[THREADS];
    const int t = threadIdx.x;
    unsigned int c = t;
    for (int k = 0; k < 8; ++k) c = c & 1 ? (c >> 1) ^ POLY : c >> 1;
    table[t] = c;
    const unsigned char* row = rows + (long long)blockIdx.y * block_stride + (long long)blockIdx.x * row_stride;
    const int piece = (width + THREADS - 1) / THREADS;
    const int begin = min(t * piece, width), end = min(begin + piece, width);
    __syncthreads();
    unsigned int crc = 0;
    for (int i = begin; i < end; ++i) crc = table[(crc ^ row[i]) & 0xFF] ^ (crc >> 8);
    crcs[t] = crc;
    lengths[t] = end - begin;
    __syncthreads();
    for (int stride = 1; stride < THREADS; stride *= 2) {
        if (t % (2 * stride) == 0) {
            unsigned int moved = crcs[t];
            int n = lengths[t + stride];
            for (int k = 3; n; n >>= 1, ++k)  // times x^(8 n): one factor per set bit of n
                if (n & 1) moved = multmodp(X2N[k & 31], moved);
            crcs[t] = moved ^ crcs[t + stride];
            lengths[t] += lengths[t + stride];
        }
        __syncthreads();
    }
    if (t == 0) out[(long long)blockIdx.y * out_stride + blockIdx.x] = crcs[0] ^ zero_crc;
}
