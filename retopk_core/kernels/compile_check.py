"""Compile every kernel ahead of time for a CUDA target, without a GPU (triton.compile + GPUTarget).

The interpreter accepts code the compiler rejects (plain-int globals, re-assigned constexprs, 16-bit
dots it evaluates wrongly), so this check runs the real front end, the GPU passes, LLVM and ptxas
(bundled with triton) on each kernel and each constexpr branch. ``--small`` uses small blocks (seconds
per kernel; what CI runs); the default uses the benchmark's shapes (K = 512, R = 4, W = 32: the
large bitonic networks take a minute each to compile).

    python -m retopk_core.kernels.compile_check [--small] [--arch 90]

Must run WITHOUT TRITON_INTERPRET (the kernels must be JIT functions, not interpreted ones).
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def kernel_specs(small: bool) -> list[tuple]:
    """(kernel, argument types, constexprs, num_warps) for every kernel and constexpr branch."""
    from retopk_core.kernels import dense, exact_support, indexed_qk, select_attend, selector

    K_pad, n_pad, n_sort, chunk, fan, D = (16, 64, 32, 32, 4, 64) if small else (512, 4096, 2048, 2048, 4, 128)
    p = {"f32": "*fp32", "bf16": "*bf16", "i64": "*i64", "i32": "*i32", "i8": "*i8"}
    specs = []
    for dt, dot_f32 in (("bf16", False), ("f32", True)):
        specs.append((dense.dense_split_kernel,
                      dict(q_ptr=p[dt], k_ptr=p[dt], v_ptr=p[dt], table_ptr=p["i64"], len_ptr=p["i64"],
                           po_ptr=p["f32"], pl_ptr=p["f32"], scale="fp32"),
                      dict(G=7, BLOCK_G=16, D=D, BLOCK_D=D, DV=D, BLOCK_DV=D, BLOCK_N=64, DOT_F32=dot_f32), 4))
        specs.append((exact_support.exact_qk_kernel,
                      dict(q_ptr=p[dt], k_ptr=p[dt], table_ptr=p["i64"], len_ptr=p["i64"], path_ptr=p["i8"],
                           groups_ptr=p["i32"], n_ptr=p["i32"], sc_ptr=p["f32"], scale="fp32"),
                      dict(G=3, BLOCK_G=16, D=D, BLOCK_D=D, BLOCK_N=64, HAS_PATH=not dot_f32, DOT_F32=dot_f32), 4))
    specs.append((dense.lse_merge_kernel, dict(po_ptr=p["f32"], pl_ptr=p["f32"], out_ptr=p["bf16"], len_ptr=p["i64"]),
                  dict(DV=D, BLOCK_DV=D, BLOCK_S=64), 4))
    for has_path in (False, True):
        specs.append((exact_support.exact_work_kernel,
                      dict(path_ptr=p["i8"] if has_path else p["i64"], heads_ptr=p["i32"], groups_ptr=p["i32"],
                           n_ptr=p["i32"]),
                      dict(HAS_PATH=has_path, BLOCK=1024), 4))
    specs.append((exact_support.chunk_topk_kernel,
                  dict(sc_ptr=p["f32"], len_ptr=p["i64"], heads_ptr=p["i32"], n_ptr=p["i32"], out_ptr=p["i64"]),
                  dict(CHUNK=chunk, K_PAD=K_pad), 8))
    specs.append((exact_support.merge_topk_kernel,
                  dict(in_ptr=p["i64"], len_ptr=p["i64"], heads_ptr=p["i32"], n_ptr=p["i32"], out_ptr=p["i64"]),
                  dict(FAN=fan, K_PAD=K_pad), 8))
    # run: K when a power of two (merge-only path for sorted supports), 0 otherwise (full sort only); succ:
    # recall_successors, whose 2 R runs of K fill the same N_SORT (K = N_SORT / 8)
    for recent, all_cand, calibrate, run, succ in ((False, False, False, n_sort // 4, False),
                                                   (True, False, False, 0, False),
                                                   (False, True, False, n_sort // 4, False),
                                                   (False, False, True, n_sort // 4, False),
                                                   (False, True, True, n_sort // 4, False),
                                                   (False, False, True, n_sort // 8, True)):
        specs.append((selector.selector_kernel,
                      dict(q_ptr=p["bf16"], slots_ptr=p["i64"], len_ptr=p["i64"], cq_ptr=p["f32"], sup_ptr=p["i64"],
                           fill_ptr=p["i64"], wptr_ptr=p["i64"], step_ptr=p["i64"], phase_ptr=p["i64"],
                           period_ptr=p["i64"], path_ptr=p["i8"],
                           maxsim_ptr=p["f32"], nscored_ptr=p["i32"], cand_ptr=p["i32"], count_ptr=p["i32"],
                           cal_count_ptr=p["i32"], at_ptr=p["i64"], merged_ptr=p["i8"], tau_ptr=p["f32"]),
                      dict(R=4, RECENT=recent, D=D, BLOCK_D=D, BLOCK_C=32, N_PAD=n_pad, N_SORT=n_sort, BLOCK_W=32,
                           RUN=run, ALL_CAND=all_cand, CALIBRATE=calibrate, GUARD=calibrate, SUCC=succ), 8))
    specs.append((indexed_qk.indexed_qk_kernel,
                  dict(q_ptr=p["bf16"], k_ptr=p["bf16"], table_ptr=p["i64"], cand_ptr=p["i32"], count_ptr=p["i32"],
                       out_ptr=p["f32"], scale="fp32"),
                  dict(D=D, BLOCK_D=D, BLOCK_M=64), 4))
    for retopk, calibrate, raise_tau in ((False, False, False), (True, False, False), (True, True, False),
                                         (True, True, True)):
        specs.append((select_attend.select_attend_kernel,
                      dict(q_ptr=p["bf16"], v_ptr=p["bf16"], table_ptr=p["i64"], path_ptr=p["i8"], cand_ptr=p["i32"],
                           cscore_ptr=p["f32"], count_ptr=p["i32"], exact_ptr=p["i64"], sel_ptr=p["i64"],
                           w_ptr=p["f32"], out_ptr=p["bf16"], slots_ptr=p["i64"], cq_ptr=p["f32"], sup_ptr=p["i64"],
                           at_ptr=p["i64"], wptr_ptr=p["i64"], fill_ptr=p["i64"], step_ptr=p["i64"],
                           len_ptr=p["i64"], cal_count_ptr=p["i32"], maxsim_ptr=p["f32"], tau_ptr=p["f32"],
                           TARGET="fp32", RATE="fp32", BAND="fp32", LO="fp32", HI="fp32", R_TARGET="fp32",
                           R_MARGIN="fp32", period_ptr=p["i64"], G_TARGET="fp32", G_FRESH="fp32"),
                      dict(K_PAD=K_pad, N_PAD=n_pad, D=D, BLOCK_D=D, DV=D, BLOCK_DV=D, BLOCK_KV=64, RETOPK=retopk,
                           CALIBRATE=calibrate, GUARD=calibrate, RAISE=raise_tau, LOG_N=n_pad.bit_length()), 8))
    return specs


def compile_one(fn, types: dict, consts: dict, num_warps: int, arch: int):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = fn.arg_names
    signature = {n: ("constexpr" if n in consts else types.get(n, "i32")) for n in names}
    src = ASTSource(fn=fn, signature=signature, constexprs={(names.index(k),): v for k, v in consts.items()})
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps})


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true", help="small blocks: fast, same code paths")
    ap.add_argument("--arch", type=int, default=90, help="CUDA compute capability x10 (90 = H100/H200)")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("unset TRITON_INTERPRET: the compile check needs JIT kernels", file=sys.stderr)
        return 2
    failures = 0
    for fn, types, consts, warps in kernel_specs(args.small):
        t0 = time.perf_counter()
        try:
            kernel = compile_one(fn, types, consts, warps, args.arch)
            smem = getattr(kernel.metadata, "shared", "?")
            print(f"ok   {fn.__name__} {consts} ({time.perf_counter() - t0:.1f} s, shared memory {smem} B)", flush=True)
        except Exception as exc:  # report every kernel, then fail
            failures += 1
            cause = f" <- {exc.__cause__!r}" if exc.__cause__ is not None else ""
            print(f"FAIL {fn.__name__} {consts}: {type(exc).__name__}: {exc}{cause}"[:4000], flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
