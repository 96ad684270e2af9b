"""Which part of the scratch int8 kernel faults: one child process per configuration (a fault ends only that
process's CUDA context), CUDA_LAUNCH_BLOCKING=1, the smoke's full-shape near-tie problems (b=1, then b=1, 2, 13,
16 of the 16-token one), each result against the bf16 reference argmax.

A configuration is a set of the scratch module's constants (DBG_MODE bits take parts of the int8 kernel's
exact epilogue out, see int8_lmhead_epi.py). Also runs compute-sanitizer's racecheck and synccheck on the first
configuration (the fault is not seen by memcheck, which serializes the warps' timing).

Usage (repo root, CUDA machine): python3 tests/gpu/wip_epi/bisect_epi.py --out $OUT [--parallel 4] [--only a,b]
CPU rehearsal: TRITON_INTERPRET=1 python tests/gpu/wip_epi/bisect_epi.py --out OUT --dry --only base,d16
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

CONFIGS: dict[str, dict] = {
    "base": {},
    "nocap": {"INT8_EXACT_MAXNREG": 0},
    "nopdl": {"USE_PDL": False},
    "d16_nocand": {"DBG_MODE": 16},
    "d1_nogather": {"DBG_MODE": 1 | 256},
    "d2_noslotstore": {"DBG_MODE": 2},
    "d4_noatomic": {"DBG_MODE": 4},
    "d8_nospill": {"DBG_MODE": 8},
    "d32_noint8store": {"DBG_MODE": 32},
    "d64_rowclamp": {"DBG_MODE": 64},
    "d192_rowrecord": {"DBG_MODE": 64 | 128},
    "d128_rowrecord_raw": {"DBG_MODE": 128},
    "d512_nobarrier": {"DBG_MODE": 512},
    "d3_nogather_nostore": {"DBG_MODE": 1 | 2 | 256},
    "s1": {"GATHER_STAGES": 1},
    "fp32dot": {"GATHER_FP32_DOT": True},
    "slots16": {"GATHER_SLOTS": 16, "GATHER_MAX_ROWS": 16},
    "gk64": {"GATHER_BLOCK_K": 64},
    "main_stages1": {"@num_stages": 1},
    "main_noevict": {"@evict_first": 0},
    "main_untiled": {"@tiled": 0},
}


def config(name: str) -> dict:
    """A configuration of this file, or a variant of bench_epi.py."""
    if name in CONFIGS:
        return CONFIGS[name]
    from tests.gpu.wip_epi.bench_epi import VARIANTS

    return VARIANTS[name]


def child(args) -> int:
    import dataclasses

    import torch

    from tests.gpu.wip_epi.bench_epi import load_epi

    new = load_epi()
    cfg = config(args.one)
    for key, value in cfg.items():
        if key.startswith("@"):
            new.KERNEL_CONFIGS = {b: dataclasses.replace(c, **{key[1:]: value}) for b, c in new.KERNEL_CONFIGS.items()}
        else:
            assert hasattr(new, key), key
            setattr(new, key, value)
    data = torch.load(args.data, mmap=True)
    dev = "cpu" if args.dry else "cuda"
    for name in ("p1", "p16"):
        w_t, x_t, want = (data[f"{name}_{k}"].to(dev) for k in ("w", "x", "want"))
        tile = new.weight_tile()
        p_t = new.quantize_lm_head_weight(w_t, tile=tile)
        batches = (1,) if name == "p1" else (1, 2, 13, 16)
        for b in batches:
            t = time.time()
            o = new.int8_lm_head_logits(x_t[:b].contiguous(), p_t, w_t, None)
            if not args.dry:
                torch.cuda.synchronize()
            got = o.argmax(-1)
            rec = {"problem": name, "b": b, "exact": int((got == want[:b]).sum()), "s": round(time.time() - t, 2)}
            if new.DBG_WORDS is not None:
                rec["dbg"] = new.DBG_WORDS.tolist()
            print("CALL " + json.dumps(rec), flush=True)
        del w_t, p_t
    print("CHILD_OK", flush=True)
    return 0


def run_one(name: str, args, env_extra: dict, prefix: list[str], timeout: int) -> dict:
    env = dict(os.environ, **env_extra)
    cmd = prefix + [sys.executable, __file__, "--one", name, "--data", args.data] + (["--dry"] if args.dry else [])
    t = time.time()
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        rc, out = p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as e:
        rc, out = "timeout", (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
    calls = [json.loads(line[5:]) for line in out.splitlines() if line.startswith("CALL ")]
    err = [line for line in out.splitlines() if "Error" in line or "ERROR" in line or "Invalid" in line]
    return {
        "name": name,
        "prefix": " ".join(prefix),
        "rc": rc,
        "ok": "CHILD_OK" in out,
        "calls": calls,
        "errors": err[-6:],
        "tail": out[-4000:] if prefix else (out[-1500:] if "CHILD_OK" not in out else ""),
        "s": round(time.time() - t, 1),
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--one")
    ap.add_argument("--data", default=str(Path(tempfile.gettempdir()) / "bisect_epi.pt"), help="the problems' file")
    ap.add_argument("--only", default="")
    ap.add_argument("--parallel", type=int, default=4)
    ap.add_argument("--budget-s", type=float, default=420)
    ap.add_argument("--no-sanitizer", action="store_true")
    ap.add_argument("--dry", action="store_true")
    args = ap.parse_args()
    if args.one:
        return child(args)
    import torch

    from tests.gpu.near_ties import bf16_reference_argmax, near_tie_problem

    t0 = time.time()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows, hid = (4096, 256) if args.dry else (248_320, 3_072)
    dev = "cpu" if args.dry else "cuda"
    data = {}
    for name, batch in (("p1", 1), ("p16", 16)):
        w_t, x_t = near_tie_problem(rows, hid, batch, 1 if batch == 1 else 16)
        want = bf16_reference_argmax(x_t.to(dev), w_t.to(dev)).cpu()
        data.update({f"{name}_w": w_t, f"{name}_x": x_t, f"{name}_want": want})
    torch.save(data, args.data)
    del data
    print(f"[{time.time() - t0:5.1f}s] problems saved", flush=True)
    names = [n for n in (args.only.split(",") if args.only else CONFIGS) if n]
    jobs = [(n, {"CUDA_LAUNCH_BLOCKING": "1"}, [], 150) for n in names]
    if not args.no_sanitizer and not args.dry and names:
        jobs.insert(1, (names[0], {}, [], 150))  # the first configuration without blocking launches too
        for tool in ("synccheck", "racecheck"):  # started first: the slowest
            jobs.insert(0, (names[0], {}, ["compute-sanitizer", "--tool", tool, "--print-limit", "20"], 300))

    def go(job):
        name, env, prefix, timeout = job
        left = args.budget_s - (time.time() - t0)
        if left < 30:
            return {"name": name, "prefix": " ".join(prefix), "skipped": "no time left"}
        r = run_one(name, args, env, prefix, int(min(timeout, left)))
        r["blocking"] = bool(env)
        line = (
            f"[{time.time() - t0:5.1f}s] {name:22s} {r['prefix'] or ('blocking' if env else 'async'):32s} "
            f"rc={r['rc']} ok={r['ok']} calls={[(c['problem'], c['b'], c['exact'], c.get('dbg')) for c in r['calls']]}"
        )
        print(line, flush=True)
        for e in r["errors"][-2:]:
            print("      " + e[:300], flush=True)
        return r

    with ThreadPoolExecutor(args.parallel) as pool:
        results = list(pool.map(go, jobs))
    (out_dir / "bisect_epi.json").write_text(json.dumps(results, indent=1) + "\n")
    passed = [
        r["name"]
        for r in results
        if r.get("ok") and r.get("blocking") and all(c["exact"] == c["b"] for c in r["calls"])
    ]
    (out_dir / "passed.txt").write_text(",".join(passed) + "\n")
    print(f"exact and fault-free: {','.join(passed)}", flush=True)
    print(f"[{time.time() - t0:5.1f}s] done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
