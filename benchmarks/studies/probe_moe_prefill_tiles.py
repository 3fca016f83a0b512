"""Grouped MoE prefill kernel vs its torch reference over small shapes and BLOCK_K (GPU only).

Found the H200 failure of 16-input dequant tiles (every table/RTN case with BK = 16 wrong, BK >= 32
exact; benchmarks/results/moe_prefill_tile_probe_h200.json), which moe_grouped now routes to the torch
reference. Run it again after a Triton upgrade to see whether the guard can go:

    python3 -m benchmarks.studies.probe_moe_prefill_tiles OUT.json
"""

import argparse
import itertools
import json

from moec.atomic import write_text
from moec.kernels import moe_prefill
from tests.kernels.moe_cases import moe_case

SHAPES = [(32, 16), (16, 32), (32, 32), (64, 32), (32, 64), (64, 64), (128, 64), (40, 24)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", help="the JSON file to write (one record per case)")
    a = ap.parse_args()
    out = []
    for kind, (D, I), bk, (N, A, E) in itertools.product(["lut2", "lut3", "rtn4", "fp8"], SHAPES, [16, 32, 64],
                                                         [(7, 2, 3), (3, 1, 6)]):
        rec = {"kind": kind, "D": D, "I": I, "block_k": bk, "N": N, "A": A, "E": E}
        try:
            x, ids, wts, w1, w3, w2 = moe_case(kind, N, A, E, D, I, 1, 1, "cuda", seed=D + I + N)
            cfg = dict(block_m=16, block_n=32, block_k=bk, num_warps=4, num_stages=3)
            got = moe_prefill._launch(x, ids, wts.float(), w1, w3, w2, cfg, None).view(N, A, D).sum(1)  # no guard
            want = moe_prefill.moe_grouped_ref(x, ids, wts, w1, w3, w2)
            rec["rel_err"] = ((got.float() - want).abs().max() / want.abs().max()).item()
        except Exception as e:
            rec["error"] = repr(e)[:200]
        out.append(rec)
    write_text(a.out, json.dumps(out, indent=0))
    bad = [r for r in out if r.get("rel_err", 0) > 2e-2 or "error" in r]
    print(len(out), "cases,", len(bad), "wrong:")
    for r in bad:
        print(r)


if __name__ == "__main__":
    main()
