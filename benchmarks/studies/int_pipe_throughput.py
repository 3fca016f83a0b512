"""Issue rate of the instructions a 2-bit table lookup is made of, on the GPU (issue 32's evidence): how many
PRMT, IMAD, IMAD.HI, LOP3, SHF and fp16x2 FMA (HFMA2) instructions an SM completes per clock, each measured
alone (8 independent dependency chains per thread, full occupancy, %clock64 around the loop), plus the mix of the
2-bit lookup (gluon_moe_decode._lookup4: per 4 codes a multiply-high, a mask, a multiply-add, a multiply-high and
two prmt) to turn the instruction counts into a codes-per-clock ceiling.

    python3 -m benchmarks.studies.int_pipe_throughput --out benchmarks/results/int_pipe_throughput_h100.json

Result: per op, `lanes_per_clk_sm` = 32 · warp instructions completed per SM per clock (128 = one warp
instruction per clock on each of the 4 schedulers). The lookup mix's `codes_per_clk_sm` and the bandwidth it
could feed at the measured SM clock (`codes_gbs`: 2-bit codes, 4 a byte) compare with the device's copy bandwidth.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

ITERS = 2048
CHAINS = 8

# one loop body per op: CHAINS independent chains r0..r7 (registers seeded from the input) updated in place
BODIES = {
    "prmt": "prmt.b32 r{i}, r{i}, s, r{j};",
    "imad": "mad.lo.u32 r{i}, r{i}, s, r{j};",
    "imad_hi": "mad.hi.u32 r{i}, r{i}, s, r{j};",
    "lop3": "lop3.b32 r{i}, r{i}, s, r{j}, 0xE8;",
    "shf": "shf.r.wrap.b32 r{i}, r{i}, r{j}, s;",
    "hfma2": "fma.rn.f16x2 r{i}, r{i}, s, r{j};",
    # the lookup of 4 codes (gluon_moe_decode._lookup4): mul.hi (the field's shift), and, mad.lo, prmt,
    # mul.hi (the selector's high half), prmt: 6 instructions, chains through the word register
    "lookup4": ("mul.hi.u32 t{i}, r{i}, 1073741824; and.b32 t{i}, t{i}, 0x03030303; "
                "mad.lo.u32 t{i}, t{i}, 34, 0x10101010; prmt.b32 u{i}, s, r{j}, t{i}; "
                "mul.hi.u32 t{i}, t{i}, 65536; prmt.b32 r{i}, s, u{i}, t{i};"),
}
OPS_PER_BODY = {"lookup4": 6}


def asm_for(op: str) -> str:
    body = " ".join(BODIES[op].format(i=i, j=(i + 1) % CHAINS) for i in range(CHAINS))
    regs = ", ".join(f"r{i}, t{i}, u{i}" for i in range(CHAINS))
    seed = " ".join(f"add.u32 r{i}, $2, {i + 1};" for i in range(CHAINS))
    fold = " ".join(f"xor.b32 acc, acc, r{i};" for i in range(CHAINS))
    return f"""{{
    .reg .b32 {regs}, s, acc, n;
    .reg .b64 c0, c1;
    .reg .pred p;
    mov.b32 s, $2; {seed} mov.u32 n, 0; mov.b32 acc, 0;
    mov.u64 c0, %clock64;
    LOOP_{op}:
    {body}
    add.u32 n, n, 1; setp.lt.u32 p, n, {ITERS}; @p bra LOOP_{op};
    mov.u64 c1, %clock64;
    {fold}
    mov.b32 $0, acc;
    sub.u64 c1, c1, c0; cvt.u32.u64 $1, c1;
    }}"""


@triton.jit
def _kernel(x_ptr, out_ptr, cyc_ptr, ASM: tl.constexpr, BLOCK: tl.constexpr):
    """One element per thread (BLOCK = 32 · warps), so the asm (and its loop label) appears once per thread."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs)
    r, c = tl.inline_asm_elementwise(asm=ASM, constraints="=r,=r,r", args=[x], dtype=(tl.int32, tl.int32),
                                     is_pure=False, pack=1)
    tl.store(out_ptr + offs, r)
    tl.store(cyc_ptr + offs, c)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    props = torch.cuda.get_device_properties(0)
    sms = props.multi_processor_count
    # 4-warp programs, 2 per SM: one wave, 8 warps an SM, 2 a scheduler, each with 8 independent chains (16 in
    # flight a scheduler: more than an integer op's latency at its issue rate), so the rate is the pipe's
    warps, per_sm = 4, 2
    block = 32 * warps
    n = block * per_sm * sms
    x = torch.randint(1, 1 << 30, (n,), dtype=torch.int32, device="cuda")
    out = torch.empty_like(x)
    cyc = torch.empty_like(x)
    res = {"bench": "int_pipe_throughput", "device": torch.cuda.get_device_name(), "sms": sms, "iters": ITERS,
           "chains": CHAINS, "date": time.strftime("%Y-%m-%d"), "records": []}
    for op in BODIES:
        src = asm_for(op)
        _kernel[(n // block,)](x, out, cyc, ASM=src, BLOCK=block, num_warps=warps)  # compile + warm
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        _kernel[(n // block,)](x, out, cyc, ASM=src, BLOCK=block, num_warps=warps)
        b.record()
        torch.cuda.synchronize()
        ms = a.elapsed_time(b)
        cycles = float(cyc.float().median())  # loop cycles of a thread (one wave: all warps resident together)
        instr = OPS_PER_BODY.get(op, 1) * CHAINS * ITERS  # per thread
        lanes_per_clk = instr * 32 * (warps * per_sm) / cycles  # per SM: every resident warp ran the loop
        rec = {"op": op, "loop_cycles_median": cycles, "ms": ms, "lanes_per_clk_sm": lanes_per_clk,
               "sm_clock_ghz_est": cycles / (ms * 1e6)}
        if op == "lookup4":  # 4 codes per 6 instructions
            rec["codes_per_clk_sm"] = lanes_per_clk / 6 * 4
            rec["codes_gbs"] = rec["codes_per_clk_sm"] * sms * rec["sm_clock_ghz_est"] / 4
        res["records"].append(rec)
        print(json.dumps(rec), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
