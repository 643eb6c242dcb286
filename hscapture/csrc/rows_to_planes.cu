// A step's rows into a ring slot's planes: the producer's write on the CUDA ring.
//
// Up to four sources, each [rows, k_i * hidden] with its own row stride (SGLang's aux layers side
// by side, then the last layer: two sources). Tensor t of the step lands in plane t of the slot:
// dst[t * plane + r * hvec + v], in 16-byte vectors (hvec of them per row of one tensor). Block
// (r, t) copies row r of tensor t. Two ways to launch it (hscapture/producer/row_kernel.py):
//
// * rows_to_planes: one launch per step from Python, through the driver, its arguments given.
// * fetch_plan + planned_rows_to_planes: captured once in the engine's own CUDA graph, after
//   the forward, with the graph's static outputs as sources. Each replay takes its destination
//   from entry `step` of a plan table in mapped host memory, where `step` (a device counter) counts
//   the replays: the host writes the entry (destination, plane, first source row, rows; its tag
//   `step` last) after it launched the replay, from what it knows then, with no launch of its
//   own. One thread (fetch_plan) waits for the tag and copies the entry into device memory, where
//   every block of the copy reads it: a read of mapped memory crosses PCIe, and one per block made
//   the copy cost ~16 us per row on the H200. A control word in the same memory turns every copy
//   off at once (the producer closed: the ring may be gone); an entry that does not come within
//   `timeout_ns` turns them off and raises the fault word, which the host reads before it
//   announces any row.

__device__ __forceinline__ void copy_row(
    const uint4* __restrict__ s0, const uint4* __restrict__ s1,
    const uint4* __restrict__ s2, const uint4* __restrict__ s3,
    long long r0, long long r1, long long r2, long long r3,
    int k0, int k1, int k2, int k3,
    long long r, int tensor, uint4* __restrict__ to, long long hvec)
{
    int t = tensor;
    const uint4* src;
    long long row;
    if (t < k0) { src = s0; row = r0; }
    else if ((t -= k0) < k1) { src = s1; row = r1; }
    else if ((t -= k1) < k2) { src = s2; row = r2; }
    else { t -= k2; src = s3; row = r3; }
    const uint4* from = src + r * row + t * hvec;
    for (long long v = threadIdx.x; v < hvec; v += blockDim.x) to[v] = from[v];
}

extern "C" __global__ void rows_to_planes(
    const uint4* __restrict__ s0, const uint4* __restrict__ s1,
    const uint4* __restrict__ s2, const uint4* __restrict__ s3,
    long long r0, long long r1, long long r2, long long r3,
    int k0, int k1, int k2, int k3,
    uint4* __restrict__ dst, long long plane, long long hvec)
{
    const long long r = blockIdx.x;
    copy_row(s0, s1, s2, s3, r0, r1, r2, r3, k0, k1, k2, k3, r, blockIdx.y,
             dst + blockIdx.y * plane + r * hvec, hvec);
}

__device__ __forceinline__ long long load_acquire(const long long* p)
{
    long long v;
    asm volatile("ld.acquire.sys.global.s64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ unsigned long long now_ns()
{
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// Plan entry: 8 int64s, [tag, destination byte address, plane (vectors), first source row, rows]. The
// replay's entry goes to `current` (4 int64s in device memory: destination, plane, first row, rows; rows
// 0 when the copies are off or the entry never came), and the counter moves on to the next replay.
extern "C" __global__ void fetch_plan(
    const long long* plan, long long* counter, long long mask, int* control, long long timeout_ns,
    long long* current)
{
    const long long step = *counter;
    const long long* e = plan + (step & mask) * 8;
    volatile int* off = control;
    const unsigned long long start = now_ns();
    long long fields[4] = {0, 0, 0, 0};
    while (!*off) {
        if (load_acquire(e) == step) {
            const volatile long long* entry = e;
            fields[0] = entry[1]; fields[1] = entry[2]; fields[2] = entry[3]; fields[3] = entry[4];
            break;
        }
        if (now_ns() - start > (unsigned long long)timeout_ns) {
            atomicExch(control + 1, 1);
            *off = 1;
            __threadfence_system();
            break;
        }
        __nanosleep(1000);
    }
    for (int i = 0; i < 4; ++i) current[i] = fields[i];
    *counter = step + 1;
}

extern "C" __global__ void planned_rows_to_planes(
    const uint4* __restrict__ s0, const uint4* __restrict__ s1,
    const uint4* __restrict__ s2, const uint4* __restrict__ s3,
    long long r0, long long r1, long long r2, long long r3,
    int k0, int k1, int k2, int k3,
    long long hvec, const long long* __restrict__ current)
{
    const long long r = blockIdx.x;
    if (r >= current[3]) return;
    uint4* dst = reinterpret_cast<uint4*>(current[0]);
    copy_row(s0, s1, s2, s3, r0, r1, r2, r3, k0, k1, k2, k3, current[2] + r, blockIdx.y,
             dst + blockIdx.y * current[1] + r * hvec, hvec);
}
