#!/usr/bin/env python3
"""Kernel-level check (and timing) of kernels/cuda/attention.cu and attention_tc.cu on a GPU, without Rust.

Compiles both files to PTX with nvcc exactly as kernels/build.rs does (compute_80, JIT-compiled by the
driver for newer GPUs), loads them with CuPy, launches the kernels with the argument lists and launch
geometry of kernels/src/ops/attention/cuda.rs, and compares O, the logsumexp and dq, dk, dv with a float64
PyTorch reference (masks built densely; rows with no visible key give 0 and no gradient) on the cases of
kernels/tests/cuda/attention.rs, for f32, bf16 on CUDA cores and bf16 on tensor cores. Exit status 1 on
any mismatch. `--bench` then times the benchmark configs (kernels only, CUDA events) next to PyTorch
sdpa flash. The Rust GPU tests remain the tests of record (they also cover the launch code); this is the
quick loop for kernel work on a GPU machine that has PyTorch and CuPy but no Rust (~20 s).

    python3 scripts/checks/check_attention_kernels.py [--bench] [--verbose]     # nvcc from $NVCC, PATH or /usr/local/cuda
"""
import argparse, math, os, shutil, subprocess, sys, tempfile, time
from pathlib import Path

import cupy as cp
import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
ap.add_argument("--bench", action="store_true", help="also time the benchmark configs")
ap.add_argument("--verbose", action="store_true", help="print every comparison, not only failures")
ARGS = ap.parse_args()
VERBOSE = ARGS.verbose


def compile_ptx(stem: str, out: Path) -> str:
    nvcc = os.environ.get("NVCC") or shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    ptx = out / f"{stem}.ptx"
    cuda = ROOT / "kernels" / "cuda"
    subprocess.run([nvcc, "-ptx", "-O3", "-std=c++17", "-lineinfo", f"-I{cuda}", "-arch=compute_80",
                    str(cuda / f"{stem}.cu"), "-o", str(ptx)], check=True)
    return str(ptx)


TMP = Path(tempfile.mkdtemp())
mod = cp.RawModule(path=compile_ptx("attention", TMP))
modtc = cp.RawModule(path=compile_ptx("attention_tc", TMP))

BQ = BK = 64
def fwd_smem(dp): return (BQ*(dp+1) + BK*(dp+1) + BQ*(BK+1))*4 + (2*BQ+BK)*4
def bwd_smem(dp): return (2*BQ*(dp+1) + 2*BK*(dp+1) + BK*(BQ+1))*4 + (4*BQ+BK)*4
def tc_smem(dp): return 3*64*(dp+8)*2 + 4*(16*68*4 + 16*72*2 + 16*(dp+4)*4) + (2*BQ+BK)*4
def tcb_smem(dp): return 4*64*(dp+8)*2 + 2*64*68*4 + 2*64*72*2 + 64*(dp+4)*4 + 128*4 + 192*4
def bucket(d): return next(p for p in [32, 64, 80, 96, 128] if d <= p)
def ptr(t):
    if t.dtype == torch.bfloat16: t = t.view(torch.int16)
    return cp.asarray(t)

def reference(q, k, v, do, mask, cu, keep, scale):
    b, hq, tq, d = q.shape; hkv, tk = k.shape[1], k.shape[2]; rep = hq // hkv
    q, k, v, do = [x.double().requires_grad_(i < 3) for i, x in enumerate([q, k, v, do])]
    kr, vr = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    i = torch.arange(tq, device=q.device)[:, None]; j = torch.arange(tk, device=q.device)[None, :]
    if mask == 1: vis = j <= (tk - tq + i)
    elif mask == 2:
        seg = torch.zeros(tk, dtype=torch.long, device=q.device)
        for s in range(len(cu) - 1): seg[cu[s]:cu[s+1]] = s
        vis = seg[:tq, None] == seg[None, :]
    else: vis = torch.ones(tq, tk, dtype=torch.bool, device=q.device)
    vis = vis[None, None].expand(b, 1, tq, tk)
    if keep is not None: vis = vis & keep.bool()[:, None, None, :]
    s = (q @ kr.transpose(-1, -2)) * scale
    s = s.masked_fill(~vis, -math.inf)
    m = s.amax(-1, keepdim=True); m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(s - m) * vis
    l = e.sum(-1, keepdim=True)
    o = (e / l.clamp_min(1e-300)) @ vr
    lse = torch.where(l[..., 0] > 0, m[..., 0] + torch.log(l[..., 0]), torch.full_like(l[..., 0], -math.inf))
    dq, dk, dv = torch.autograd.grad(o, (q, k, v), do)
    return o.detach(), lse.detach(), dq, dk, dv

def run(q, k, v, do, mask, cu, keep, scale, dt, recompute=False, tc=False, fwd_only=False):
    """Launches the kernels as kernels/src/ops/attention/cuda.rs does; returns O, lse, dq, dk, dv."""
    b, hq, tq, d = q.shape; hkv, tk = k.shape[1], k.shape[2]; dp = bucket(d)
    dev = q.device
    cu_t = torch.tensor(cu if cu else [0], dtype=torch.int32, device=dev)
    keep_t = keep.to(torch.uint8).contiguous() if keep is not None else torch.ones(1, dtype=torch.uint8, device=dev)
    args_mask = (ptr(keep_t), ptr(cu_t), np.int32(max(len(cu) - 1, 0)))
    if tc:
        f = modtc.get_function(f"attention_fwd_tc_bf16_{dp}"); f.max_dynamic_shared_size_bytes = tc_smem(dp); nthr = 128; fsm = tc_smem(dp)
    else:
        f = mod.get_function(f"attention_fwd_{dt}_{dp}"); f.max_dynamic_shared_size_bytes = fwd_smem(dp); nthr = 256; fsm = fwd_smem(dp)
    out = torch.empty_like(q); lse = torch.empty(b, hq, tq, dtype=torch.float32, device=dev)
    grid = ((tq + BQ - 1) // BQ, b * hq)
    f(grid, (nthr,), (ptr(q), np.int32(d), ptr(k), ptr(v), ptr(out), ptr(lse), *args_mask, np.int32(hq), np.int32(hkv),
          np.int32(tq), np.int32(tk), np.int32(d), np.int32(mask), np.int32(keep is not None), np.float32(scale)),
      shared_mem=fsm)
    if fwd_only:
        return out
    qod = torch.cat([q, out, do], 3).contiguous()
    rows = b * hq * tq
    lse_b = lse
    if recompute:
        lse_b = torch.empty_like(lse); o2 = torch.empty_like(q)
        f(grid, (nthr,), (ptr(qod), np.int32(3 * d), ptr(k), ptr(v), ptr(o2), ptr(lse_b), *args_mask, np.int32(hq),
              np.int32(hkv), np.int32(tq), np.int32(tk), np.int32(d), np.int32(mask), np.int32(keep is not None),
              np.float32(scale)), shared_mem=fsm)
    delta = torch.empty(rows, dtype=torch.float32, device=dev)
    mod.get_function(f"attention_delta_{dt}")(((rows + 7) // 8,), (256,), (ptr(qod), ptr(delta), np.int64(rows), np.int32(d)))
    nq, nk = q.numel(), k.numel()
    dacc = torch.zeros(nq + 2 * nk, dtype=torch.float32, device=dev)
    if tc:
        g = modtc.get_function(f"attention_bwd_tc_bf16_{dp}"); g.max_dynamic_shared_size_bytes = tcb_smem(dp); bsm = tcb_smem(dp); bthr = 128
    else:
        g = mod.get_function(f"attention_bwd_{dt}_{dp}"); g.max_dynamic_shared_size_bytes = bwd_smem(dp); bsm = bwd_smem(dp); bthr = 256
    g(((tk + BK - 1) // BK, b * hq), (bthr,), (ptr(qod), ptr(k), ptr(v), ptr(lse_b), ptr(delta), ptr(dacc), *args_mask,
       np.int32(b), np.int32(hq), np.int32(hkv), np.int32(tq), np.int32(tk), np.int32(d), np.int32(mask),
       np.int32(keep is not None), np.float32(scale)), shared_mem=bsm)
    if dt == "bf16":
        res = torch.empty(nq + 2 * nk, dtype=torch.bfloat16, device=dev)
        n = nq + 2 * nk
        mod.get_function("attention_cast_bf16")((min((n + 255) // 256, 65535),), (256,), (ptr(dacc), ptr(res), np.int64(n)))
        dacc = res
    return out, lse, dacc[:nq].view(q.shape), dacc[nq:nq+nk].view(k.shape), dacc[nq+nk:].view(k.shape)

def cmp(label, got, want, atol, rtol):
    got, want = got.double(), want.double()
    e = (got - want).abs()
    finite = torch.isfinite(want)
    e = torch.where(finite, e, torch.where(got == want, torch.zeros_like(e), torch.full_like(e, math.inf)))
    bad = ~(e <= atol + rtol * want.abs().nan_to_num(0, 0, 0))
    i = int(e.nan_to_num(math.inf).argmax())
    idx = np.unravel_index(i, tuple(got.shape))
    ok = int(bad.sum()) == 0
    if not ok or VERBOSE: print(f"{'ok  ' if ok else 'FAIL'} {label}: max abs {float(e.flatten()[i]):.3e} at {idx} got {float(got.flatten()[i]):.5f} want {float(want.flatten()[i]):.5f}; bad {int(bad.sum())}/{e.numel()}")
    return ok

def windows(t, w): return list(range(0, t, w)) + [t]
cases = [  # name, b, hq, hkv, tq, tk, d, mask, cu, pad(bi, from, to)
  ("t1_causal", 1, 4, 2, 1, 1, 64, 1, None, None),
  ("t7_gqa7_d80", 2, 7, 1, 7, 7, 80, 1, None, None),
  ("t129_gqa7_d128", 1, 14, 2, 129, 129, 128, 1, None, None),
  ("t129_none_d80", 1, 2, 2, 129, 129, 80, 0, None, None),
  ("t70_causal_pad_rows_without_keys", 2, 2, 1, 70, 70, 64, 1, None, (1, 0, 5)),
  ("decode_t7_tk1000_gqa7", 1, 7, 1, 7, 1000, 128, 1, None, None),
  ("decode_t1_tk129_pad", 2, 4, 2, 1, 129, 64, 1, None, (1, 0, 40)),
  ("t1000_none_pad", 2, 2, 2, 1000, 1000, 64, 0, None, (1, 900, 1000)),
  ("t4097_causal_d128", 1, 4, 2, 4097, 4097, 128, 1, None, None),
  ("decode_t129_tk4097_d80", 1, 4, 2, 129, 4097, 80, 1, None, None),
  ("decode_t1_tk1000_gqa7_pad", 2, 14, 2, 1, 1000, 128, 1, None, (1, 0, 300)),
  ("win_varied_d80", 1, 4, 2, 1000, 1000, 80, 2, [0, 64, 65, 100, 229, 229, 1000], None),
  ("win64_d80", 1, 4, 4, 1000, 1000, 80, 2, windows(1000, 64), None),
  ("win_odd_gqa7_d128", 1, 7, 1, 300, 300, 128, 2, [0, 1, 130, 300], None),
  ("d17", 1, 4, 2, 77, 77, 17, 1, None, None),
  ("d32", 1, 4, 2, 77, 77, 32, 1, None, None),
  ("d48_none", 1, 2, 1, 77, 100, 48, 0, None, None),
  ("d96_win", 1, 2, 2, 150, 150, 96, 2, [0, 70, 150], None),
]
def bench():
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def ms(fn, it=10):
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        s, e, ts = torch.cuda.Event(True), torch.cuda.Event(True), []
        for _ in range(it):
            s.record(); fn(); e.record(); torch.cuda.synchronize(); ts.append(s.elapsed_time(e))
        return sorted(ts)[len(ts) // 2]

    configs = [("decoder-3b", 1, 16, 2, 4096, 128, 1, None), ("decoder-3b-1k", 1, 16, 2, 1024, 128, 1, None),
               ("vision-window", 1, 16, 16, 4096, 80, 2, 64), ("vision-full", 1, 16, 16, 4096, 80, 0, None)]
    for name, b, hq, hkv, t, d, mask, win in configs:
        cu = list(range(0, t, win)) + [t] if win else []
        for dt, tdt, tc in [("bf16", torch.bfloat16, True), ("bf16", torch.bfloat16, False), ("f32", torch.float32, False)]:
            q = torch.randn(b, hq, t, d, device="cuda", dtype=tdt)
            k, v = torch.randn(b, hkv, t, d, device="cuda", dtype=tdt), torch.randn(b, hkv, t, d, device="cuda", dtype=tdt)
            g = torch.randn_like(q)
            sc = 1 / math.sqrt(d)
            fwd = ms(lambda: run(q, k, v, g, mask, cu, None, sc, dt, tc=tc, fwd_only=True))
            both = ms(lambda: run(q, k, v, g, mask, cu, None, sc, dt, tc=tc))
            ref = ""
            if tc and not win:
                qq, kk, vv = [x.clone().requires_grad_() for x in (q, k, v)]
                with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                    rf = ms(lambda: F.scaled_dot_product_attention(qq, kk, vv, is_causal=mask == 1, enable_gqa=True))

                    def fb():
                        o = F.scaled_dot_product_attention(qq, kk, vv, is_causal=mask == 1, enable_gqa=True)
                        torch.autograd.grad(o, (qq, kk, vv), g)
                    rb = ms(fb)
                ref = f" | sdpa flash: fwd {rf:.3f} ms, fwd+bwd {rb:.3f} ms"
            kind = "tensor cores" if tc else "CUDA cores"
            print(f"{name} {dt} ({kind}): fwd {fwd:.3f} ms, fwd+bwd kernels {both:.3f} ms{ref}", flush=True)


torch.manual_seed(0)
allok = True
for name, b, hq, hkv, tq, tk, d, mask, cu, pad in cases:
    keep = None
    if pad:
        keep = torch.ones(b, tk, device="cuda"); keep[pad[0], pad[1]:pad[2]] = 0
    x = [(torch.rand(b, h, t, d, device="cuda") * 4 - 2) for h, t in [(hq, tq), (hkv, tk), (hkv, tk)]]
    do = torch.rand(b, hq, tq, d, device="cuda") * 2 - 1
    scale = 1 / math.sqrt(d)
    for dt, tdt, (fa, fr, ga, gr), tc in [("f32", torch.float32, (1e-4, 1e-4, 5e-4, 1e-3), False), ("bf16", torch.bfloat16, (1e-2, 1e-2, 2e-2, 2e-2), False), ("bf16", torch.bfloat16, (1e-2, 1e-2, 2e-2, 2e-2), True)]:
        q, k, v, g = [t.to(tdt).contiguous() for t in x + [do]]
        for rec in ([False, True] if name in ("t129_gqa7_d128", "win_varied_d80", "t70_causal_pad_rows_without_keys") else [False]):
            t0 = time.time()
            o, lse, dq, dk, dv = run(q, k, v, g, mask, cu or [], keep, scale, dt, rec, tc)
            torch.cuda.synchronize()
            ro, rlse, rdq, rdk, rdv = reference(q, k, v, g, mask, cu or [], keep, scale)
            # The kernels' D_i uses their own (rounded) O, as in training: so does this reference's backward?
            lab = f"{name} {dt}{' tc' if tc else ''}{' recompute' if rec else ''}"
            ok = cmp(lab + " O", o, ro, fa, fr) & cmp(lab + " lse", lse, rlse, 1e-3, 1e-4)
            ok &= cmp(lab + " dq", dq, rdq, ga, gr) & cmp(lab + " dk", dk, rdk, ga, gr) & cmp(lab + " dv", dv, rdv, ga, gr)
            allok &= ok
print("ALL OK" if allok else "SOME FAILED")
if ARGS.bench:
    bench()
shutil.rmtree(TMP, ignore_errors=True)
sys.exit(0 if allok else 1)
