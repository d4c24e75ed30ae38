# Probe 29: (1) the example's one-rank step in PyTorch: does a copy with few CTAs (Triton)
# hide behind the GEMMs where cudaMemcpyAsync's copy does not? (2) are GEMMs slower on
# ncclMemAlloc memory, or on memory registered as an NCCL window?
import ctypes, sys, time, torch, triton, triton.language as tl
torch.cuda.init()
dev = torch.device("cuda")
print("torch", torch.__version__, torch.version.cuda, torch.cuda.get_device_name(), "triton", triton.__version__, flush=True)
SMS = torch.cuda.get_device_properties(0).multi_processor_count

@triton.jit
def copy_k(src, dst, n, BLOCK: tl.constexpr, NPROG: tl.constexpr, STREAM: tl.constexpr):
    pid = tl.program_id(0)
    for start in range(pid * BLOCK, n, NPROG * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        m = offs < n
        if STREAM:
            v = tl.load(src + offs, mask=m, eviction_policy="evict_first", cache_modifier=".cg")
            tl.store(dst + offs, v, mask=m, cache_modifier=".cs")
        else:
            v = tl.load(src + offs, mask=m)
            tl.store(dst + offs, v, mask=m)

def tcopy(dst, src, nprog, stream_hint, warps=16, block=8192):
    s = src.view(torch.int32); d = dst.view(torch.int32)
    copy_k[(nprog,)](s, d, s.numel(), BLOCK=block, NPROG=nprog, STREAM=stream_hint, num_warps=warps)

def step(h, b, L, method, prio, reps=5):
    """The example's one-rank step: forward L GEMMs, each after its layer's gather (one
    ahead), backward dW + dX with re-gathers one ahead, SGD on the rs stream."""
    g = torch.Generator(device=dev); g.manual_seed(1)
    shards = [torch.randn(h * h, device=dev, dtype=torch.bfloat16, generator=g) * 0.01 for _ in range(L)]
    X = torch.randn(h, b, device=dev, dtype=torch.bfloat16, generator=g)
    acts = [torch.empty(h, b, device=dev, dtype=torch.bfloat16) for _ in range(L)]
    grads = [torch.randn(h, b, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(2)]
    fulls = [torch.empty(h * h, device=dev, dtype=torch.bfloat16) for _ in range(3)]
    dws = [torch.empty(h, h, device=dev, dtype=torch.bfloat16) for _ in range(2)]
    lo, hi = torch.cuda.Stream.priority_range() if hasattr(torch.cuda.Stream, "priority_range") else (0, -1)
    cs = torch.cuda.Stream()
    ag = torch.cuda.Stream(priority=-1 if prio else 0)
    rs = torch.cuda.Stream()
    nf = [0]
    def gather(l):
        full = fulls[nf[0] % 3]; nf[0] += 1
        with torch.cuda.stream(ag):
            if method == "none":
                pass
            elif method == "memcpy":
                full.copy_(shards[l], non_blocking=True)
            else:
                _, nprog, hint = method.split(":")
                tcopy(full, shards[l], int(nprog), hint == "s")
            ev = torch.cuda.Event(); ev.record(ag)
        return full.view(h, h), ev
    def one():
        s0 = torch.cuda.Event(enable_timing=True); e = torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        s0.record(cs)
        ag.wait_event(s0); rs.wait_event(s0)
        ahead = [gather(0)]
        for l in range(L):
            W, ev = ahead.pop(0)
            cs.wait_event(ev)
            if l + 1 < L:
                ahead.append(gather(l + 1))
            with torch.cuda.stream(cs):
                torch.mm(W, X if l == 0 else acts[l - 1], out=acts[l])
        cur = W
        for l in reversed(range(L)):
            if ahead:
                W, ev = ahead.pop(0); cs.wait_event(ev)  # (gathered one ahead below)
                cur = W
            if l > 0:
                ahead.append(gather(l - 1))
            with torch.cuda.stream(cs):
                dw = dws[l % 2]
                torch.mm(grads[(l + 1) % 2], (X if l == 0 else acts[l - 1]).t(), out=dw)
                ready = torch.cuda.Event(); ready.record(cs)
                if l > 0:
                    torch.mm(cur.t(), grads[(l + 1) % 2], out=grads[l % 2])
            rs.wait_event(ready)
            with torch.cuda.stream(rs):
                shards[l].add_(dw.view(-1), alpha=-1e-6)
        for s in (ag, rs):
            ev = torch.cuda.Event(); ev.record(s); cs.wait_event(ev)
        e.record(cs)
        torch.cuda.synchronize()
        return s0.elapsed_time(e)
    one()
    ts = sorted(one() for _ in range(reps))
    return ts[len(ts) // 2]

def probe_step():
    for (h, b, L, label) in [(16384, 1024, 8, "balanced"), (4096, 1024, 8, "default")]:
        base = None
        methods = ["none", "memcpy", f"t:{SMS}:n", "t:66:n", "t:32:n", "t:16:n", "t:8:n", "t:32:s", "t:16:s", "t:8:s", "t:4:s"]
        for prio in (False, True):
            for m in methods:
                if prio and m == "none":
                    continue
                try:
                    t = step(h, b, L, m, prio)
                except Exception as ex:
                    print(label, m, "failed", ex, flush=True); continue
                if m == "none":
                    base = t
                print(f"step {label:9s} {m:10s} prio={int(prio)} {t:8.3f} ms  ÷none {t/base:6.3f}", flush=True)
        # the copy alone at each width
        src = torch.randn(h * h, device=dev, dtype=torch.bfloat16); dst = torch.empty_like(src)
        for m in methods[1:]:
            def go():
                if m == "memcpy": dst.copy_(src)
                else:
                    _, n, hint = m.split(":"); tcopy(dst, src, int(n), hint == "s")
            go(); torch.cuda.synchronize()
            t = triton.testing.do_bench(go, warmup=20, rep=100, return_mode="median")
            ok = torch.equal(dst, src) if m != "memcpy" else True
            print(f"copy {label:9s} {m:10s} {t*1e3:8.1f} us  {2*src.numel()*2/t/1e9:6.0f} GB/s r+w  correct {ok}", flush=True)

# (2) GEMMs on NCCL memory
def probe_nccl_memory():
    nccl = ctypes.CDLL("libnccl.so.2")
    v = ctypes.c_int(); nccl.ncclGetVersion(ctypes.byref(v)); print("nccl", v.value, flush=True)
    class UID(ctypes.Structure): _fields_ = [("internal", ctypes.c_char * 128)]
    uid = UID(); assert nccl.ncclGetUniqueId(ctypes.byref(uid)) == 0
    comm = ctypes.c_void_p()
    r = nccl.ncclCommInitRank(ctypes.byref(comm), 1, uid, 0); assert r == 0, r
    class Arr:
        def __init__(self, ptr, n):
            self.__cuda_array_interface__ = {"shape": (n,), "typestr": "<i2", "data": (ptr, False), "version": 3}
    h, b = 16384, 1024
    n = h * h; size = n * 2
    def nalloc():
        p = ctypes.c_void_p(); r = nccl.ncclMemAlloc(ctypes.byref(p), ctypes.c_size_t(size)); assert r == 0, r
        return p, torch.as_tensor(Arr(p.value, n), device=dev).view(torch.bfloat16)
    ref = torch.randn(n, device=dev, dtype=torch.bfloat16)
    W = {"torch": torch.empty(n, device=dev, dtype=torch.bfloat16)}
    pn, W["ncclMemAlloc"] = nalloc()
    pw, W["window"] = nalloc()
    win = ctypes.c_void_p()
    r = nccl.ncclCommWindowRegister(comm, pw, ctypes.c_size_t(size), ctypes.byref(win), 1); print("window register rc", r, flush=True)
    pr, W["commRegister"] = nalloc()
    hdl = ctypes.c_void_p(); r = nccl.ncclCommRegister(comm, pr, ctypes.c_size_t(size), ctypes.byref(hdl)); print("comm register rc", r, flush=True)
    for w in W.values(): w.copy_(ref)
    X = torch.randn(h, b, device=dev, dtype=torch.bfloat16); Y = torch.empty(h, b, device=dev, dtype=torch.bfloat16)
    G = torch.randn(h, b, device=dev, dtype=torch.bfloat16)
    for rnd in range(2):
        for k, w in W.items():
            Wm = w.view(h, h)
            t_read = triton.testing.do_bench(lambda: torch.mm(Wm, X, out=Y), warmup=25, rep=200, return_mode="median")
            t_readT = triton.testing.do_bench(lambda: torch.mm(Wm.t(), G, out=Y), warmup=25, rep=200, return_mode="median")
            t_write = triton.testing.do_bench(lambda: torch.mm(G, X.t(), out=Wm), warmup=25, rep=200, return_mode="median")
            t_axpy = triton.testing.do_bench(lambda: w.add_(ref, alpha=1e-6), warmup=25, rep=200, return_mode="median")
            print(f"mem round {rnd} {k:13s} gemm reads W {t_read*1e3:7.1f} us | reads Wᵀ {t_readT*1e3:7.1f} us | writes W {t_write*1e3:7.1f} us | axpy into W {t_axpy*1e3:7.1f} us", flush=True)

probe_nccl_memory()
probe_step()
