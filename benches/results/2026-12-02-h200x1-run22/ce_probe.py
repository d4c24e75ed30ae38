# Probe: does a one-GPU 512 MiB copy hide behind GEMMs? cudaMemcpyAsync D2D (torch copy_)
# against cuMemcpyBatchAsync with and without CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE.
import ctypes, sys, torch
torch.cuda.init()
dev = torch.device("cuda")
cuda = ctypes.CDLL("libcuda.so.1")
class Loc(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]
class Attr(ctypes.Structure):
    _fields_ = [("srcAccessOrder", ctypes.c_int), ("srcLocHint", Loc), ("dstLocHint", Loc), ("flags", ctypes.c_uint)]
try:
    fn = cuda.cuMemcpyBatchAsync_v2; V2 = True
except AttributeError:
    fn = cuda.cuMemcpyBatchAsync; V2 = False
drv = ctypes.c_int(); cuda.cuDriverGetVersion(ctypes.byref(drv))
print("driver", drv.value, "batch v2", V2, "torch", torch.__version__, torch.version.cuda, torch.cuda.get_device_name())

def batch(dst, src, nbytes, stream, flags, chunks=1, order=1):
    per = nbytes // chunks
    D = (ctypes.c_uint64 * chunks)(*[dst + i * per for i in range(chunks)])
    S = (ctypes.c_uint64 * chunks)(*[src + i * per for i in range(chunks)])
    Z = (ctypes.c_size_t * chunks)(*([per] * chunks))
    a = Attr(order, Loc(1, 0), Loc(1, 0), flags)
    idx = (ctypes.c_size_t * 1)(0)
    if V2:
        r = fn(D, S, Z, ctypes.c_size_t(chunks), ctypes.byref(a), idx, ctypes.c_size_t(1), ctypes.c_void_p(stream))
    else:
        fail = ctypes.c_size_t(0)
        r = fn(D, S, Z, ctypes.c_size_t(chunks), ctypes.byref(a), idx, ctypes.c_size_t(1), ctypes.byref(fail), ctypes.c_void_p(stream))
    if r != 0:
        raise RuntimeError(f"cuMemcpyBatchAsync -> {r}")

def run(h, b, ncopy, ngemm, method, label):
    W = [torch.randn(h, h, device=dev, dtype=torch.bfloat16) for _ in range(2)]
    X = torch.randn(h, b, device=dev, dtype=torch.bfloat16)
    Y = torch.empty(h, b, device=dev, dtype=torch.bfloat16)
    src = torch.randn(h * h, device=dev, dtype=torch.bfloat16)
    dsts = [torch.empty_like(src) for _ in range(2)]
    nbytes = src.numel() * 2
    A = torch.cuda.Stream(); B = torch.cuda.Stream()
    def copy(dst):
        if method == "memcpy":
            dst.copy_(src, non_blocking=True)
        elif method.startswith("batch"):
            _, flags, chunks = method.split(":")
            batch(dst.data_ptr(), src.data_ptr(), nbytes, torch.cuda.current_stream().cuda_stream, int(flags), int(chunks))
    def timed(do_gemm, do_copy, reps=3):
        best = None
        for _ in range(reps):
            torch.cuda.synchronize()
            s0 = torch.cuda.Event(enable_timing=True); ea = torch.cuda.Event(enable_timing=True); eb = torch.cuda.Event(enable_timing=True)
            s0.record()
            A.wait_event(s0); B.wait_event(s0)
            for i in range(max(ngemm, ncopy)):
                if do_copy and i < ncopy:
                    with torch.cuda.stream(B): copy(dsts[i % 2])
                if do_gemm and i < ngemm:
                    with torch.cuda.stream(A): torch.mm(W[i % 2], X, out=Y)
            with torch.cuda.stream(A): ea.record()
            with torch.cuda.stream(B): eb.record()
            torch.cuda.synchronize()
            r = (s0.elapsed_time(ea), s0.elapsed_time(eb))
            best = r if best is None or max(r) < max(best) else best
        return best
    timed(True, True, 1)
    g, _ = timed(True, False)
    _, c = timed(False, True)
    ga, cb = timed(True, True)
    if method != "none":
        dsts[0].zero_(); torch.cuda.synchronize(); copy(dsts[0]); torch.cuda.synchronize()
        ok = torch.equal(dsts[0], src)
    else:
        ok = True
    print(f"{label:9s} {method:14s} gemms {ngemm}x solo {g:7.3f} ms | copies {ncopy}x{nbytes>>20} MiB solo {c:7.3f} ms ({nbytes*2*ncopy/c/1e9:6.0f} GB/s r+w) | together: gemm stream {ga:7.3f} copy stream {cb:7.3f} span/gemm-solo {max(ga,cb)/g:6.3f} correct {ok}", flush=True)

for (h, b, label) in [(16384, 1024, "balanced"), (4096, 1024, "default")]:
    for m in ["memcpy", "batch:0:1", "batch:1:1", "batch:1:4", "batch:0:4"]:
        try:
            run(h, b, 15, 24, m, label)
        except Exception as e:
            print(label, m, "failed:", e, flush=True)
