"""Exploration run for the int8 lm head (issue 10): timing methods, bandwidth references, kernel variants.

One device call measures, on the 248,320 x 3,072 lm head:

* the copy reference (``copy_`` of an int8-weight-sized buffer) and a read-only stream of the same bytes;
* the bf16 GEMM, the old kernel (``--old MODULE``: the file before this change) and the current one;
* kernel variants (tensor-core configs) and the exact path;

each timed two ways: ``flush`` (``triton.testing.do_bench``: an L2 flush, i.e. a 256 MB memset, before
every call, and CUDA events around the call) and ``graph`` (a CUDA graph of ``GRAPH_CALLS`` back-to-back
calls, replayed; median per call over the replays; no flush: every operand but x is far larger than
the L2). Results go to ``--json``; a short table is printed last.

The logs in benchmarks/results/gpu/int8_lmhead_h200_explore*.log come from earlier versions of this script
and of the kernels, which also timed designs no longer in the tree (a CUDA-core GEMV path; re-scoring
from per-block maxima with per-token candidate lists; one re-scoring program per vocab block; the
exact path stage by stage). Run: ``python3 tests/gpu/explore_int8_lmhead.py --json OUT.json``;
``--exact-only --old OLD.py`` times only the exact path: the old module against this one's re-scoring
variants (``EXACT_VARIANTS``; logs explore7-9). ``--profile [--old OLD.py]`` (explore13) profiles each
module's exact path kernel by kernel (torch.profiler over a CUDA graph replay: device time of every kernel
and the gaps between them) next to the kernel alone and the bf16 GEMM.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

GRAPH_CALLS = 10
GRAPH_REPLAYS = 15


def t_flush(fn) -> float:
    import triton

    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def capture_graph(fn, calls: int):
    """A CUDA graph of ``calls`` back-to-back calls of ``fn`` (warmed up outside the capture), replayed once."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    return graph


def t_graph(fn, calls: int = GRAPH_CALLS, replays: int = GRAPH_REPLAYS) -> float:
    """Median time of one call (ms) over replays of a CUDA graph of ``calls`` back-to-back calls."""
    import torch

    graph = capture_graph(fn, calls)
    times = []
    for _ in range(replays):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    del graph
    return statistics.median(times)


VARIANT_BATCHES = (1, 4, 16, 32)
# Re-scoring variants of the exact path: module constants of sparkfleet.kernels.int8_lmhead set for the run.
EXACT_VARIANTS = {
    "default": {},
    "programs_x2": {"RESCORE_PROGRAMS": 1024, "RESCORE_MIN_PROGRAMS_PER_ROW": 32, "RESCORE_MAX_PROGRAMS_PER_ROW": 128},
    "min32": {"RESCORE_MIN_PROGRAMS_PER_ROW": 32},
    "g8_s2_programs_x2": {
        "RESCORE_GROUP": 8,
        "RESCORE_SLOTS": 2,
        "RESCORE_PROGRAMS": 1024,
        "RESCORE_MIN_PROGRAMS_PER_ROW": 32,
        "RESCORE_MAX_PROGRAMS_PER_ROW": 128,
    },
    "g4_s2_min32": {"RESCORE_GROUP": 4, "RESCORE_SLOTS": 2, "RESCORE_MIN_PROGRAMS_PER_ROW": 32},
}


@contextlib.contextmanager
def module_constants(L, consts: dict):
    """Set module constants of sparkfleet.kernels.int8_lmhead for a block, then put the old values back."""
    saved = {k: getattr(L, k) for k in consts}
    try:
        for k, v in consts.items():
            setattr(L, k, v)
        yield
    finally:
        for k, v in saved.items():
            setattr(L, k, v)


def time_exact_variant(L, consts, batches, packed, weight, x, ref, facts=None) -> dict:
    """Graph time and argmax check of the exact path per batch with ``consts`` set; errors are recorded."""
    import torch

    rec = {"constants": consts}
    try:
        with module_constants(L, consts):
            for b in batches:
                xb = x[:b].contiguous()
                exact = L.int8_lm_head_logits(xb, packed, weight)
                if facts is not None:
                    rec[f"b{b}_facts"] = facts()
                rec[f"b{b}_ok"] = bool(torch.equal(exact.argmax(-1), ref[b]))
                rec[f"b{b}"] = t_graph(lambda xb=xb: L.int8_lm_head_logits(xb, packed, weight))
    except Exception as exc:  # noqa: BLE001
        rec["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    return rec


def explore_exact(L, weight, x, old_path, log) -> dict:
    """Old exact path (file at ``old_path``) against this module's, per batch; variants at 1, 4, 16."""
    import torch

    out: dict = {"bf16": {}, "old": {}, "new": {}, "variants": {}}
    ref = {b: torch.nn.functional.linear(x[:b], weight).argmax(-1) for b in (1, 2, 4, 8, 13, 16, 32)}
    if old_path:
        spec = importlib.util.spec_from_file_location("old_int8_lmhead", old_path)
        old = importlib.util.module_from_spec(spec)
        sys.modules["old_int8_lmhead"] = old
        spec.loader.exec_module(old)
        packed_old = old.quantize_lm_head_weight(weight, tile=old.weight_tile())
        for b in ref:
            xb = x[:b].contiguous()
            rec = {
                "kernel": t_graph(lambda xb=xb: old.int8_lm_head_logits(xb, packed_old, weight, exact_argmax=False)),
                "exact": t_graph(lambda xb=xb: old.int8_lm_head_logits(xb, packed_old, weight)),
            }
            out["old"][b] = rec
            log(f"old b={b}: kernel {rec['kernel'] * 1e3:.1f} exact {rec['exact'] * 1e3:.1f} us")
        del packed_old
        torch.cuda.empty_cache()
    packed = L.quantize_lm_head_weight(weight, tile=L.weight_tile())
    for b in ref:
        xb = x[:b].contiguous()
        out["bf16"][b] = t_graph(lambda xb=xb: torch.nn.functional.linear(xb, weight))
        exact = L.int8_lm_head_logits(xb, packed, weight)
        rec = {
            "kernel": t_graph(lambda xb=xb: L.int8_lm_head_logits(xb, packed, weight, exact_argmax=False)),
            "exact": t_graph(lambda xb=xb: L.int8_lm_head_logits(xb, packed, weight)),
            "argmax_ok": bool(torch.equal(exact.argmax(-1), ref[b])),
        }
        out["new"][b] = rec
        log(
            f"new b={b}: bf16 {out['bf16'][b] * 1e3:.1f} kernel {rec['kernel'] * 1e3:.1f} exact "
            f"{rec['exact'] * 1e3:.1f} us (x{out['bf16'][b] / rec['exact']:.3f}) argmax ok {rec['argmax_ok']}"
        )
    for name, consts in EXACT_VARIANTS.items():
        rec = time_exact_variant(L, consts, VARIANT_BATCHES, packed, weight, x, ref)
        out["variants"][name] = rec
        log(
            f"exact variant {name}: "
            + ", ".join(f"b{b} {rec[f'b{b}'] * 1e3:.1f} ({rec[f'b{b}_ok']})" for b in VARIANT_BATCHES if f"b{b}" in rec)
            + (f" ERROR {rec['error']}" if "error" in rec else "")
        )
    return out


RESCORE_BATCHES = (1, 4, 8, 16)
# Re-scoring kernel variants (explore10): module constants set for the run.
RESCORE_VARIANTS = {
    # explore10 (log int8_lmhead_h200_explore10.log) swept one constant at a time from GROUP 8, chunk 1024;
    # explore11 from the chosen GROUP 4. "previous" is the kernel before explore10 (one 4096 chunk, GROUP 8).
    "default": {},
    "previous": {"RESCORE_CHUNK_K": 4096, "RESCORE_GROUP": 8},
    "chunk4096": {"RESCORE_CHUNK_K": 4096},
    "group2": {"RESCORE_GROUP": 2},
    "slots1": {"RESCORE_SLOTS": 1},
    "p16": {"RESCORE_MIN_PROGRAMS_PER_ROW": 16, "RESCORE_MAX_PROGRAMS_PER_ROW": 16},
    "p32": {"RESCORE_MIN_PROGRAMS_PER_ROW": 32, "RESCORE_MAX_PROGRAMS_PER_ROW": 32},
    "maxnreg80": {"RESCORE_MAXNREG": 80},
}


class _Recorder:
    """Stands in for a Triton kernel: launches it and keeps what the launch returned (the compiled kernel)."""

    def __init__(self, fn) -> None:
        self.fn = fn
        self.compiled = None

    def __getitem__(self, grid):
        launch = self.fn[grid]

        def run(*args, **kwargs):
            self.compiled = launch(*args, **kwargs)
            return self.compiled

        return run


def _compiled_facts(compiled) -> dict:
    if compiled is None:
        return {}
    meta = getattr(compiled, "metadata", None)
    return {
        "n_regs": getattr(compiled, "n_regs", None),
        "n_spills": getattr(compiled, "n_spills", None),
        "shared": getattr(meta, "shared", None),
        "num_warps": getattr(meta, "num_warps", None),
    }


def candidate_stats(L, packed, weight, x, programs_per_row: int) -> dict:
    """Approximate candidate counts per token (no fp32 margins): rows and blocks whose bound reaches the
    exact logit of the largest int8 logit, and the most owned by one re-scoring program."""
    import torch

    block_v = packed.tile[0] if packed.tile else 128
    zq = L.int8_lm_head_logits(x, packed, weight, exact_argmax=False).double()
    z = x.double() @ weight.double().T
    bound = L.int8_logit_error_bound(x, packed)
    best = zq.argmax(-1)
    lb = z.gather(1, best[:, None])
    rows = (zq + bound) >= lb
    num_rows = weight.shape[0]
    nb = -(-num_rows // block_v)
    pad = nb * block_v - num_rows
    padded_rows = torch.nn.functional.pad(rows, (0, pad)).view(x.shape[0], nb, block_v)
    cand_blocks = padded_rows.any(-1)
    owner = torch.arange(nb, device=x.device) % programs_per_row
    per_prog_rows = torch.zeros(x.shape[0], programs_per_row, device=x.device, dtype=torch.long)
    per_prog_rows.index_add_(1, owner, padded_rows.sum(-1).long())
    per_prog_blocks = torch.zeros_like(per_prog_rows)
    per_prog_blocks.index_add_(1, owner, cand_blocks.long())
    return {
        "rows_per_token": rows.sum(-1).tolist(),
        "blocks_per_token": cand_blocks.sum(-1).tolist(),
        "max_rows_per_program": per_prog_rows.max(-1).values.tolist(),
        "max_blocks_per_program": per_prog_blocks.max(-1).values.tolist(),
    }


def explore_rescore(L, weight, x, log) -> dict:
    """The re-scoring kernel: its registers, candidate counts, and constant variants (explore10)."""
    import torch

    out: dict = {"batches": {}, "variants": {}}
    packed = L.quantize_lm_head_weight(weight, tile=L.weight_tile())
    ref = {b: torch.nn.functional.linear(x[:b], weight).argmax(-1) for b in RESCORE_BATCHES}
    recorder = _Recorder(L._exact_rescore_kernel)
    real = L._exact_rescore_kernel
    L._exact_rescore_kernel = recorder
    try:
        for b in RESCORE_BATCHES:
            xb = x[:b].contiguous()
            L.int8_lm_head_logits(xb, packed, weight)
            facts = _compiled_facts(recorder.compiled)
            ppr = max(L.RESCORE_MIN_PROGRAMS_PER_ROW, min(L.RESCORE_MAX_PROGRAMS_PER_ROW, L.RESCORE_PROGRAMS // b))
            cands = candidate_stats(L, packed, weight, xb, ppr)
            rec = {
                "bf16": t_graph(lambda xb=xb: torch.nn.functional.linear(xb, weight)),
                "kernel": t_graph(lambda xb=xb: L.int8_lm_head_logits(xb, packed, weight, exact_argmax=False)),
                "exact": t_graph(lambda xb=xb: L.int8_lm_head_logits(xb, packed, weight)),
                "rescore_kernel": facts,
                "programs_per_row": ppr,
                "candidates": cands,
            }
            out["batches"][b] = rec
            log(
                f"b={b}: bf16 {rec['bf16'] * 1e3:.1f} kernel {rec['kernel'] * 1e3:.1f} "
                f"exact {rec['exact'] * 1e3:.1f} us "
                f"(x{rec['bf16'] / rec['exact']:.3f}, re-scoring {(rec['exact'] - rec['kernel']) * 1e3:.1f}); "
                f"rescore kernel {facts}; programs/token {ppr}; "
                f"candidate rows/token max {max(cands['rows_per_token'])}, "
                f"blocks max {max(cands['blocks_per_token'])}, "
                f"most rows per program {max(cands['max_rows_per_program'])}, "
                f"most blocks per program {max(cands['max_blocks_per_program'])}"
            )
        for name, consts in RESCORE_VARIANTS.items():
            rec = time_exact_variant(
                L, consts, RESCORE_BATCHES, packed, weight, x, ref, facts=lambda: _compiled_facts(recorder.compiled)
            )
            out["variants"][name] = rec
            log(
                f"rescore variant {name}: "
                + ", ".join(
                    f"b{b} {rec[f'b{b}'] * 1e3:.1f} ({rec[f'b{b}_ok']}, regs {rec[f'b{b}_facts'].get('n_regs')}"
                    f"/spills {rec[f'b{b}_facts'].get('n_spills')})"
                    for b in RESCORE_BATCHES
                    if f"b{b}" in rec
                )
                + (f" ERROR {rec['error']}" if "error" in rec else "")
            )
    finally:
        L._exact_rescore_kernel = real
    return out


TRACE_VARIANTS = {
    "default": {},
    "slots1": {"RESCORE_SLOTS": 1},
    "p16": {"RESCORE_MIN_PROGRAMS_PER_ROW": 16, "RESCORE_MAX_PROGRAMS_PER_ROW": 16},
}


def summarize_trace(trace) -> dict:
    """Where the re-scoring kernel's time goes, from its per-program record (TRACE_FIELDS)."""
    import torch

    t = trace.reshape(-1, trace.shape[-1]).double().cpu()
    sm, gt_start, gt_wait, gt_end, c_start, c_wait, c_thr, c_end, blocks, rows = t.unbind(1)
    ghz = torch.median((c_end - c_start) / (gt_end - gt_start).clamp(min=1)).item()
    release = gt_wait.min()
    end_rel = (gt_end - release) / 1e3
    start_rel = (gt_start - release) / 1e3
    to_thr = (c_thr - c_wait) / ghz / 1e3
    after_thr = (c_end - c_thr) / ghz / 1e3
    wait_after_release = (gt_wait - release) / 1e3
    last = int(torch.argmax(gt_end))

    def q(v):
        return [round(torch.quantile(v, f).item(), 2) for f in (0.5, 0.9, 1.0)]

    return {
        "programs": int(t.shape[0]),
        "sms_used": int(torch.unique(sm).numel()),
        "most_programs_on_one_sm": int(torch.bincount(sm.long()).max()),
        "clock_ghz": round(ghz, 3),
        "span_after_release_us": round(end_rel.max().item(), 2),
        "started_after_release_frac": round((start_rel > 0.5).double().mean().item(), 3),
        "start_after_release_us_p50_p90_max": q(start_rel),
        "wait_released_after_us_p50_p90_max": q(wait_after_release),
        "wait_to_threshold_us_p50_p90_max": q(to_thr),
        "threshold_to_end_us_p50_p90_max": q(after_thr),
        "end_us_p50_p90_max": q(end_rel),
        "candidate_blocks_p50_p90_max": q(blocks),
        "rows_rescored_p50_p90_max": q(rows),
        "last_program": {
            "start_us": round(start_rel[last].item(), 2),
            "wait_released_us": round(wait_after_release[last].item(), 2),
            "wait_to_threshold_us": round(to_thr[last].item(), 2),
            "threshold_to_end_us": round(after_thr[last].item(), 2),
            "blocks": int(blocks[last]),
            "rows": int(rows[last]),
        },
    }


def explore_trace(L, weight, x, log) -> dict:
    """The re-scoring kernel's per-program timestamps (explore12): waves, stages, the last program."""
    out: dict = {}
    packed = L.quantize_lm_head_weight(weight, tile=L.weight_tile())
    for name, consts in TRACE_VARIANTS.items():
        try:
            with module_constants(L, consts):
                for b in (1, 4, 8, 16):
                    xb = x[:b].contiguous()
                    for _ in range(3):
                        L.int8_lm_head_logits(xb, packed, weight)
                    traces: list = []
                    for _ in range(5):
                        L.int8_lm_head_logits(xb, packed, weight, trace=traces)
                    summaries = [summarize_trace(tr) for tr in traces]
                    spans = [r["span_after_release_us"] for r in summaries]
                    best = sorted(summaries, key=lambda r: r["span_after_release_us"])[len(summaries) // 2]
                    out[f"{name}_b{b}"] = {"median_run": best, "spans_us": spans}
                    log(f"trace {name} b={b}: {best} spans {spans}")
        except Exception as exc:  # noqa: BLE001
            out[f"{name}_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            log(f"trace {name} ERROR {out[f'{name}_error']}")
    return out


def profile_kernels(fn, calls: int = GRAPH_CALLS, replays: int = 5) -> dict:
    """Per-kernel device time inside a CUDA graph of ``calls`` back-to-back calls (torch.profiler, CUPTI):
    for each kernel of one call, in launch order, its median duration and the median gap from the end of
    the kernel before it (negative: it overlapped, programmatic dependent launch); and the call's span."""
    import os
    import tempfile

    import torch

    graph = capture_graph(fn, calls)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    del graph
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        events = json.loads(Path(path).read_text()).get("traceEvents", [])
    kernels = sorted((e for e in events if e.get("cat") == "kernel" and "dur" in e), key=lambda e: float(e["ts"]))
    if not kernels or len(kernels) % (calls * replays):
        return {"error": f"{len(kernels)} kernel records for {calls * replays} calls"}
    per_call = len(kernels) // (calls * replays)
    names = [k["name"][:60] for k in kernels[:per_call]]
    durs = [[] for _ in range(per_call)]
    gaps = [[] for _ in range(per_call)]
    spans = []
    for c in range(calls * replays):
        ks = kernels[c * per_call : (c + 1) * per_call]
        for i, k in enumerate(ks):
            start, dur = float(k["ts"]), float(k["dur"])
            durs[i].append(dur)
            if i > 0:
                prev = ks[i - 1]
                gaps[i].append(start - float(prev["ts"]) - float(prev["dur"]))
            elif c > 0:
                prev = kernels[c * per_call - 1]
                gaps[i].append(start - float(prev["ts"]) - float(prev["dur"]))
        spans.append(float(ks[-1]["ts"]) + float(ks[-1]["dur"]) - float(ks[0]["ts"]))
    med = lambda v: round(statistics.median(v), 2) if v else None  # noqa: E731
    return {
        "kernels": [
            {"name": n, "us": med(d), "gap_before_us": med(g)} for n, d, g in zip(names, durs, gaps, strict=True)
        ],
        "span_us": med(spans),
    }


def explore_profile(modules: dict, weight, x, log, batches=(1, 4, 16)) -> dict:
    """Where the exact path's time goes: graph time and per-kernel profile of each module's exact path
    and kernel alone (``modules``: name -> module), next to the bf16 GEMM (explore13)."""
    import torch

    out: dict = {}
    for b in batches:
        xb = x[:b].contiguous()
        out[f"bf16_b{b}"] = t_graph(lambda xb=xb: torch.nn.functional.linear(xb, weight))
        log(f"bf16 b={b}: {out[f'bf16_b{b}'] * 1e3:.1f} us")
    for name, mod in modules.items():
        packed = mod.quantize_lm_head_weight(weight, tile=mod.weight_tile())
        for b in batches:
            xb = x[:b].contiguous()
            ref = torch.nn.functional.linear(xb, weight).argmax(-1)
            for path, exact in (("kernel", False), ("exact", True)):
                fn = lambda xb=xb, e=exact, m=mod, p=packed: m.int8_lm_head_logits(xb, p, weight, exact_argmax=e)  # noqa: E731
                rec = {"graph_ms": t_graph(fn), "profile": profile_kernels(fn)}
                if exact:
                    rec["argmax_ok"] = bool(torch.equal(fn().argmax(-1), ref))
                    rec["x_bf16"] = out[f"bf16_b{b}"] / rec["graph_ms"]
                out[f"{name}_{path}_b{b}"] = rec
                log(f"profile {name} {path} b={b}: {rec}")
        del packed
        torch.cuda.empty_cache()
    return out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", required=True)
    parser.add_argument("--old", help="path of the previous int8_lmhead.py, timed for comparison")
    parser.add_argument("--budget-s", type=float, default=360.0)
    for mode, text in (  # the modes, each a switch
        ("--exact-only", "time only the exact path: the old module's (--old) against this one's re-scoring variants"),
        ("--rescore", "the re-scoring kernel only (explore10)"),
        ("--trace", "the re-scoring kernel's timestamps (explore12)"),
        ("--profile", "per-kernel profile of the exact path (explore13); --old too"),
    ):
        parser.add_argument(mode, action="store_true", help=text)
    args = parser.parse_args()

    import torch
    import triton

    from sparkfleet.kernels import int8_lmhead as L

    t_start = time.monotonic()
    res: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
    lines: list[str] = []

    def log(msg: str) -> None:
        print(msg, flush=True)
        lines.append(msg)

    def left() -> float:
        return args.budget_s - (time.monotonic() - t_start)

    def finish() -> int:
        """Write the results and the log to --json."""
        res["log"] = lines
        Path(args.json).write_text(json.dumps(res, indent=1, default=str) + "\n")
        log(f"done in {time.monotonic() - t_start:.0f} s")
        return 0

    rows, hidden = 248_320, 3_072
    gen = torch.Generator(device="cuda").manual_seed(0)
    weight = (torch.randn(rows, hidden, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
    x = torch.randn(64, hidden, device="cuda", generator=gen).to(torch.bfloat16)
    n8 = rows * hidden

    if args.profile:
        modules = {"new": L}
        if args.old:
            spec = importlib.util.spec_from_file_location("old_int8_lmhead", args.old)
            old = importlib.util.module_from_spec(spec)
            sys.modules["old_int8_lmhead"] = old
            spec.loader.exec_module(old)
            modules = {"old": old, "new": L}
        res["profile"] = explore_profile(modules, weight, x, log)
        return finish()

    if args.trace:
        res["trace"] = explore_trace(L, weight, x, log)
        return finish()

    if args.rescore:
        res["rescore"] = explore_rescore(L, weight, x, log)
        if args.old:
            res["exact_variants"] = explore_exact(L, weight, x, args.old, log)
        return finish()

    if args.exact_only:
        res["exact_variants"] = explore_exact(L, weight, x, args.old, log)
        return finish()

    # References.
    src = torch.randint(-127, 127, (n8,), dtype=torch.int8, device="cuda")
    dst = torch.empty_like(src)
    ref = {}
    ref["copy_flush_ms"] = t_flush(lambda: dst.copy_(src))
    ref["copy_graph_ms"] = t_graph(lambda: dst.copy_(src))
    import triton.language as tl

    @triton.jit
    def _stream_read_kernel(src_ptr, out_ptr, n, BLOCK: tl.constexpr, EVICT_FIRST: tl.constexpr):
        acc = tl.zeros([BLOCK], dtype=tl.int32)
        for start in range(tl.program_id(0) * BLOCK, n, tl.num_programs(0) * BLOCK):
            if EVICT_FIRST:
                v = tl.load(src_ptr + start + tl.arange(0, BLOCK), eviction_policy="evict_first")
            else:
                v = tl.load(src_ptr + start + tl.arange(0, BLOCK))
            acc ^= v.to(tl.int32)
        tl.store(out_ptr + tl.program_id(0), tl.sum(acc, axis=0))

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    sink = torch.empty(sms * 64, dtype=torch.int32, device="cuda")
    best_read = None
    for block, warps, per_sm, evict in [
        (4096, 4, 8, 0),
        (8192, 8, 4, 0),
        (8192, 4, 8, 1),
        (16384, 8, 4, 1),
        (4096, 4, 16, 1),
        (16384, 16, 2, 0),
    ]:
        n = n8 // block * block
        grid = sms * per_sm

        def read(block=block, warps=warps, grid=grid, n=n, evict=evict):
            _stream_read_kernel[(grid,)](src, sink, n, BLOCK=block, EVICT_FIRST=evict, num_warps=warps)

        ms = t_graph(read)
        gbps = n / ms / 1e6
        ref[f"read_{block}_{warps}w_{per_sm}x_ev{evict}_graph_ms"] = ms
        log(f"read-only block {block} warps {warps} {per_sm}/SM evict {evict}: {ms * 1e3:.1f} us, {gbps:.0f} GB/s")
        if best_read is None or gbps > best_read:
            best_read = gbps
    ref["read_best_GBps"] = best_read
    ref["copy_graph_GBps"] = 2 * n8 / ref["copy_graph_ms"] / 1e6
    ref["copy_flush_GBps"] = 2 * n8 / ref["copy_flush_ms"] / 1e6
    log(
        f"copy: flush {ref['copy_flush_ms'] * 1e3:.1f} us ({ref['copy_flush_GBps']:.0f} GB/s), graph "
        f"{ref['copy_graph_ms'] * 1e3:.1f} us ({ref['copy_graph_GBps']:.0f} GB/s); read-only best {best_read:.0f} GB/s"
    )
    res["ref"] = ref

    bf16 = {}
    for b in (1, 2, 4, 8, 13, 16, 32):
        xb = x[:b].contiguous()
        bf16[b] = {
            "flush": t_flush(lambda xb=xb: torch.nn.functional.linear(xb, weight)),
            "graph": t_graph(lambda xb=xb: torch.nn.functional.linear(xb, weight)),
        }
        log(f"bf16 b={b}: flush {bf16[b]['flush'] * 1e3:.1f} graph {bf16[b]['graph'] * 1e3:.1f} us")
    res["bf16"] = bf16

    if args.old:
        spec = importlib.util.spec_from_file_location("old_int8_lmhead", args.old)
        old = importlib.util.module_from_spec(spec)
        sys.modules["old_int8_lmhead"] = old
        spec.loader.exec_module(old)
        packed_old = old.quantize_lm_head_weight(weight, tile=old.weight_tile())
        res["old"] = {}
        for b in (1, 4, 16):
            xb = x[:b].contiguous()
            rec = {}
            for exact in (False, True):
                fn = lambda xb=xb, e=exact: old.int8_lm_head_logits(xb, packed_old, weight, exact_argmax=e)  # noqa: E731
                rec[f"{'exact' if exact else 'kernel'}_flush"] = t_flush(fn)
                rec[f"{'exact' if exact else 'kernel'}_graph"] = t_graph(fn)
            res["old"][b] = rec
            log(f"old b={b}: " + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in rec.items()))
        del packed_old

    packs: dict = {}

    def packed_for(tile):
        if tile not in packs:
            packs.clear()
            torch.cuda.empty_cache()
            packs[tile] = L.quantize_lm_head_weight(weight, tile=tile)
        return packs[tile]

    K = L.KernelConfig
    tc = []
    for bv, bk, warps, stages, conv, ev, ppsm in [
        (128, 128, 4, 3, 0, 1, 0),
        (128, 128, 4, 3, 0, 0, 0),
        (128, 128, 4, 4, 0, 1, 0),
        (128, 128, 8, 4, 0, 1, 0),
        (128, 128, 4, 3, 0, 1, 0),
        (128, 256, 4, 2, 0, 1, 0),
        (128, 256, 4, 2, 0, 0, 0),
        (64, 128, 4, 4, 0, 1, 0),
    ]:
        tc.append(K(bv, 16, bk, warps, stages, conv, 0, ppsm, 1, ev))
    res["variants"] = []
    for cfg in tc:
        if left() < 120:
            log("variants: budget reached")
            break
        packed = packed_for((cfg.block_v, cfg.block_k))
        batches = (1, 4, 16)
        rec = {"config": dataclasses.asdict(cfg)}
        try:
            for b in batches:
                xb = x[:b].contiguous()
                fn = lambda xb=xb, c=cfg, p=packed: L.int8_lm_head_logits(xb, p, weight, exact_argmax=False, config=c)  # noqa: E731
                rec[f"b{b}_graph"] = t_graph(fn)
        except Exception as exc:  # noqa: BLE001
            rec["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        res["variants"].append(rec)
        log(
            f"variant {cfg}: "
            + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in rec.items() if k.endswith("graph"))
            + (f" ERROR {rec['error']}" if "error" in rec else "")
        )

    # The exact path (kernel with block maxima, re-scoring) next to the kernel alone.
    packed = packed_for(L.weight_tile())
    res["exact"] = {}
    for b in (1, 4, 16):
        xb = x[:b].contiguous()
        rec = {
            "kernel_graph": t_graph(lambda xb=xb: L.int8_lm_head_logits(xb, packed, weight, exact_argmax=False)),
            "exact_graph": t_graph(lambda xb=xb: L.int8_lm_head_logits(xb, packed, weight)),
        }
        res["exact"][b] = rec
        log(f"exact path b={b}: " + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in rec.items()))
    return finish()


if __name__ == "__main__":
    sys.exit(main())
