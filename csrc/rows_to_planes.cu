// A step's rows into a ring slot's planes in one launch: the producer's write on the CUDA ring.
//
// Up to four sources, each [rows, k_i * hidden] with its own row stride (SGLang's aux layers side
// by side, then the last layer: two sources). Tensor t of the step lands in plane t of the slot:
// dst[t * plane + r * hvec + v], in 16-byte vectors (hvec of them per row of one tensor). Block
// (r, t) copies row r of tensor t. Launched through the driver (hscapture/producer/row_kernel.py):
// a decode step's write costs one launch from Python, not torch's dispatch of a strided cat.

extern "C" __global__ void rows_to_planes(
    const uint4* __restrict__ s0, const uint4* __restrict__ s1,
    const uint4* __restrict__ s2, const uint4* __restrict__ s3,
    long long r0, long long r1, long long r2, long long r3,
    int k0, int k1, int k2, int k3,
    uint4* __restrict__ dst, long long plane, long long hvec)
{
    const long long r = blockIdx.x;
    const int tensor = blockIdx.y;
    int t = tensor;
    const uint4* src;
    long long row;
    if (t < k0) { src = s0; row = r0; }
    else if ((t -= k0) < k1) { src = s1; row = r1; }
    else if ((t -= k1) < k2) { src = s2; row = r2; }
    else { t -= k2; src = s3; row = r3; }
    const uint4* from = src + r * row + t * hvec;
    uint4* to = dst + tensor * plane + r * hvec;
    for (long long v = threadIdx.x; v < hvec; v += blockDim.x) to[v] = from[v];
}
