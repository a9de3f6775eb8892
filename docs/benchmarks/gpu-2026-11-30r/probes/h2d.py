# ruff: noqa  (the probe as it ran on the device; a record, not maintained code)
"""Device probe (not committed): ways to bring a safetensors checkpoint onto the GPU."""
import concurrent.futures as cf
import glob
import json
import os
import sys
import time

import torch
from safetensors import safe_open

M = sys.argv[1]
files = sorted(glob.glob(f"{M}/*.safetensors"))
dev = torch.device("cuda")
torch.cuda.init()
torch.empty(1, device=dev)
DT = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


def header(f):
    with open(f, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        h = json.loads(fh.read(n))
    h.pop("__metadata__", None)
    return 8 + n, sorted(h.items(), key=lambda kv: kv[1]["data_offsets"][0])


def a_current():
    out = {}
    for f in files:
        with safe_open(f, framework="pt") as s:
            for k in s.keys():
                t = s.get_tensor(k)
                d = torch.empty(t.shape, dtype=t.dtype, device=dev)
                d.copy_(t)
                out[k] = d
    torch.cuda.synchronize()
    return out


def b_pinned_torch(chunk=64 << 20):
    bufs = [torch.empty(chunk, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
    ev = [None, None]
    out, i = {}, 0
    for f in files:
        with safe_open(f, framework="pt") as s:
            for k in s.keys():
                t = s.get_tensor(k)
                d = torch.empty(t.shape, dtype=t.dtype, device=dev)
                src, dst = t.reshape(-1).view(torch.uint8), d.view(-1).view(torch.uint8)
                for st in range(0, src.numel(), chunk):
                    n = min(chunk, src.numel() - st)
                    j = i % 2
                    if ev[j] is not None:
                        ev[j].synchronize()
                    bufs[j][:n].copy_(src[st:st + n])
                    dst[st:st + n].copy_(bufs[j][:n], non_blocking=True)
                    e = torch.cuda.Event(); e.record(); ev[j] = e
                    i += 1
                out[k] = d
    torch.cuda.synchronize()
    return out


def c_pread(threads=8, chunk=32 << 20, ring=12):
    bufs = [torch.empty(chunk, dtype=torch.uint8, pin_memory=True) for _ in range(ring)]
    views = [memoryview(b.numpy()) for b in bufs]
    ev = [None] * ring
    out = {}
    pieces = []  # (fd, file offset, n, dst bytes, dst offset)
    fds = []
    for f in files:
        base, items = header(f)
        fd = os.open(f, os.O_RDONLY)
        fds.append(fd)
        for name, meta in items:
            s, e = meta["data_offsets"]
            d = torch.empty(meta["shape"], dtype=DT[meta["dtype"]], device=dev)
            out[name] = d
            db = d.view(-1).view(torch.uint8)
            for st in range(0, e - s, chunk):
                pieces.append((fd, base + s + st, min(chunk, e - s - st), db, st))
    pool = cf.ThreadPoolExecutor(threads)

    def read(k, p):
        fd, off, n, _, _ = p
        mv = views[k % ring][:n]
        got = 0
        while got < n:
            got += os.preadv(fd, [mv[got:]], off + got)
        return k

    futs = {}
    nxt = 0

    def submit_upto(limit):
        nonlocal nxt
        while nxt < len(pieces) and nxt < limit:
            j = nxt % ring
            if ev[j] is not None:
                ev[j].synchronize()
                ev[j] = None
            futs[nxt] = pool.submit(read, nxt, pieces[nxt])
            nxt += 1

    submit_upto(ring)
    for k, p in enumerate(pieces):
        futs.pop(k).result()
        _, _, n, db, st = p
        j = k % ring
        db[st:st + n].copy_(bufs[j][:n], non_blocking=True)
        e = torch.cuda.Event(); e.record(); ev[j] = e
        submit_upto(k + 1 + ring)
    torch.cuda.synchronize()
    pool.shutdown()
    for fd in fds:
        os.close(fd)
    return out


def d_read_only(threads=8, chunk=32 << 20):
    bufs = [torch.empty(chunk, dtype=torch.uint8, pin_memory=True) for _ in range(threads)]
    total = 0
    jobs = []
    for f in files:
        size = os.path.getsize(f)
        fd = os.open(f, os.O_RDONLY)
        for st in range(0, size, chunk):
            jobs.append((fd, st, min(chunk, size - st)))
    def read(i, j):
        fd, off, n = j
        mv = memoryview(bufs[i % threads].numpy())[:n]
        return os.preadv(fd, [mv], off)
    with cf.ThreadPoolExecutor(threads) as pool:
        total = sum(pool.map(read, range(len(jobs)), jobs))
    return total


res = {}
nbytes = sum(os.path.getsize(f) for f in files)
res["bytes"] = nbytes
for name, fn in (("a", a_current), ("b", b_pinned_torch), ("c8", c_pread),
                 ("c4", lambda: c_pread(4)), ("c16", lambda: c_pread(16, 16 << 20, 24)),
                 ("d8", d_read_only), ("a2", a_current), ("c8b", c_pread)):
    t = time.perf_counter()
    r = fn()
    dt = time.perf_counter() - t
    res[name] = round(dt, 3)
    if name == "a":
        ref = r
    elif isinstance(r, dict):
        res[name + "_ok"] = r.keys() == ref.keys() and all(torch.equal(r[k], ref[k]) for k in ref)
    del r
    torch.cuda.empty_cache()
    print(name, res[name], flush=True)
print(json.dumps(res))
