"""EXPERIMENT: does a tiled weight layout (each TMA box of W contiguous in memory) stream
faster than the row-major one at 8 rows? Standalone kernel, CUDA-graph timings, rotating
weights (8 copies > L2)."""
import json
import sys

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor


@triton.jit
def _kernel(x_desc, w_desc, y_ptr, M, N, stride_ym, KC: tl.constexpr, TILED: tl.constexpr,
            M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
            GLU: tl.constexpr):
    pid = tl.program_id(0)
    off_n = pid * BLOCK_N
    acc = tl.zeros([BLOCK_N, M_PAD], tl.float32)
    acc_up = tl.zeros([BLOCK_N, M_PAD], tl.float32)
    up_tile = pid + N // BLOCK_N
    for kc in range(0, KC):
        x = x_desc.load([0, kc * BLOCK_K])
        if TILED:
            w = w_desc.load([(pid * KC + kc) * BLOCK_N, 0])
        else:
            w = w_desc.load([off_n, kc * BLOCK_K])
        acc = tl.dot(w, x.T, acc)
        if GLU:
            if TILED:
                wu = w_desc.load([(up_tile * KC + kc) * BLOCK_N, 0])
            else:
                wu = w_desc.load([off_n + N, kc * BLOCK_K])
            acc_up = tl.dot(wu, x.T, acc_up)
    offs_n = off_n + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, M_PAD)
    mask = (offs_n < N)[:, None] & (offs_m < M)[None, :]
    y = acc
    if GLU:
        g = acc.to(tl.bfloat16).to(tl.float32)
        y = (g / (1 + tl.exp(-g))).to(tl.bfloat16).to(tl.float32) * acc_up.to(tl.bfloat16).to(tl.float32)
    tl.store(y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None], y.to(tl.bfloat16), mask=mask)


def tile(w, bn, bk):
    n, k = w.shape
    return w.view(n // bn, bn, k // bk, bk).permute(0, 2, 1, 3).contiguous().view(-1, bk)


def run(x, w, tiled, glu, bn=64, bk=128, stages=None):
    m, k = x.shape
    n = w.shape[0] // (2 if glu else 1) if not tiled else (w.numel() // k) // (2 if glu else 1)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    xd = TensorDescriptor(x, [m, k], [x.stride(0), 1], [16, bk])
    wd = TensorDescriptor(w, list(w.shape), [w.stride(0), 1], [bn, bk])
    _kernel[(triton.cdiv(n, bn),)](xd, wd, y, m, n, y.stride(0), KC=k // bk, TILED=tiled,
                                   M_PAD=16, BLOCK_N=bn, BLOCK_K=bk, GLU=glu, num_warps=4,
                                   num_stages=stages or (5 if glu else 4))
    return y


def time_graph(fn, reps=8, calls=16):
    fn(0)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(calls):
            fn(i)
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        for i in range(calls):
            fn(i)
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(True), torch.cuda.Event(True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) * 1000 / calls)
    return sorted(ts)[len(ts) // 2]


def main(out):
    from arle_kernels.gemv import gemv, gemv_silu_mul
    torch.manual_seed(0)
    res = {}
    for name, (n, k, glu) in {"gate_up": (19456, 2560, True), "down": (2560, 9728, False),
                              "qkv": (6144, 2560, False), "lm_head": (151936, 2560, False)}.items():
        copies = 2 if name == "lm_head" else 8
        ws = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") / 50 for _ in range(copies)]
        wt = [tile(w, 64, 128) for w in ws]
        x = torch.randn(8, k, dtype=torch.bfloat16, device="cuda")
        a = run(x, ws[0], False, glu)
        b = run(x, wt[0], True, glu)
        ref = gemv_silu_mul(x, ws[0]) if glu else gemv(x, ws[0])
        r = {"bytes": n * k * 2, "same_as_plain": bool(torch.equal(a, b)),
             "max_diff_vs_arle": float((a.float() - ref.float()).abs().max())}
        def arle(i, x=x, ws=ws, copies=copies, glu=glu):
            return gemv_silu_mul(x, ws[i % copies]) if glu else gemv(x, ws[i % copies])

        def ours(i, tiled, stages=None, x=x, ws=ws, wt=wt, copies=copies, glu=glu):
            return run(x, (wt if tiled else ws)[i % copies], tiled, glu, stages=stages)

        r["arle_us"] = time_graph(arle)
        r["plain_us"] = time_graph(lambda i: ours(i, False))
        r["tiled_us"] = time_graph(lambda i: ours(i, True))
        for st in (3, 6):
            if glu and st == 6:
                continue
            r[f"tiled_st{st}_us"] = time_graph(lambda i, st=st: ours(i, True, st))
        for key in [kk for kk in r if kk.endswith("_us")]:
            r[key.replace("_us", "_TBps")] = r["bytes"] / r[key] / 1e6
        res[name] = r
        print(name, json.dumps(r), flush=True)
        del ws, wt
        torch.cuda.empty_cache()
    with open(out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
