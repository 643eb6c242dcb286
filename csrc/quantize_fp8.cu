// fp8 quantization of bf16 rows in one launch: hscapture.fp8.quantize_into's codes, scales and
// non-finite counts, bit for bit, for a [tensors, rows, hidden] block of a CUDA ring slot.
//
// One thread block per (row, tensor). Per row: amax = the largest |x| over its finite values;
// scale = amax / 448 (an IEEE float division), 1 where that is 0; each finite x is stored as the
// e4m3fn code of x / scale (IEEE division, then PyTorch's float -> float8_e4m3fn rounding: nearest,
// ties to even, 480 and above NaN), each NaN or inf as 0x7F, and counted. The rounding is spelled
// out below rather than taken from cuda_fp8.h, whose conversion may round twice.
// Compiled at run time with NVRTC (cupy.RawModule); hscapture/consumer/device_fp8.py falls back to
// hscapture.fp8.quantize_into (about ten torch kernels) where it cannot.

#define THREADS 256

__device__ __forceinline__ unsigned char e4m3fn_code(float f) {
    unsigned int bits = __float_as_uint(f);
    const unsigned int sign = bits & 0x80000000u;
    bits ^= sign;
    unsigned char code;
    if (bits >= (1087u << 20)) {             // |f| >= 480 (or NaN): NaN
        code = 0x7Fu;
    } else if (bits < (121u << 23)) {        // |f| < 2^-6: a subnormal code, rounded by a float add
        const unsigned int magic = 141u << 23;
        code = (unsigned char)(__float_as_uint(__fadd_rn(__uint_as_float(bits), __uint_as_float(magic))) - magic);
    } else {                                  // normal: rebias the exponent, round the mantissa to 3 bits
        const unsigned int odd = (bits >> 20) & 1u;
        bits += (unsigned int)(7 - 127) * (1u << 23) + 0x7FFFFu + odd;
        code = (unsigned char)(bits >> 20);
    }
    return code | (unsigned char)(sign >> 24);
}

extern "C" __global__ void quantize_bf16_rows(
    const unsigned short* __restrict__ rows, long long tensor_stride, int hidden,
    unsigned char* __restrict__ codes, float* __restrict__ scales, int* __restrict__ nonfinite, int out_rows)
{
    const int row = blockIdx.x, tensor = blockIdx.y;
    const unsigned short* x = rows + tensor * tensor_stride + (long long)row * hidden;
    const long long out = (long long)tensor * out_rows + row;
    float amax = 0.0f;
    int bad = 0;
    for (int i = threadIdx.x; i < hidden; i += THREADS) {
        const float v = __uint_as_float((unsigned int)x[i] << 16);
        if (isfinite(v)) amax = fmaxf(amax, fabsf(v)); else ++bad;
    }
    for (int offset = 16; offset; offset >>= 1) {
        amax = fmaxf(amax, __shfl_down_sync(0xffffffffu, amax, offset));
        bad += __shfl_down_sync(0xffffffffu, bad, offset);
    }
    __shared__ float warp_amax[THREADS / 32];
    __shared__ int warp_bad[THREADS / 32];
    __shared__ float row_scale;
    if ((threadIdx.x & 31) == 0) {
        warp_amax[threadIdx.x >> 5] = amax;
        warp_bad[threadIdx.x >> 5] = bad;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < THREADS / 32; ++w) {
            amax = fmaxf(amax, warp_amax[w]);
            bad += warp_bad[w];
        }
        const float scale = __fdiv_rn(amax, 448.0f);
        row_scale = scale > 0.0f ? scale : 1.0f;
        scales[out] = row_scale;
        nonfinite[out] = bad;
    }
    __syncthreads();
    const float scale = row_scale;
    unsigned char* y = codes + out * hidden;
    for (int i = threadIdx.x; i < hidden; i += THREADS) {
        const float v = __uint_as_float((unsigned int)x[i] << 16);
        y[i] = isfinite(v) ? e4m3fn_code(__fdiv_rn(v, scale)) : (unsigned char)0x7Fu;
    }
}
