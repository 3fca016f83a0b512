"""GPU smoke: every shipped recipe's GPU path, with default arguments, against the torch reference.

    bash benchmarks/gpu_smoke.sh [OUT.json]        (on the GPU machine; about 3-4 minutes on one H100 or H200)

CI runs on a CPU, where the runtime takes the torch path, so a slip in the GPU path lands silently (one
did: the static engine crashed on its first decode step with default arguments). This script is the gate
before anything else runs on the GPU (benchmarks/gpu_sweep.sh starts with it). For each shipped recipe
(moec.calibrate.recipe.shipped_gpu_recipes: every recipe under moec/recipes/ and moec/recipes/ablations/ but the
identity and the ablations of one setting, whose description starts "ablation of") on the
`smoke-moe` preset (head_dim 128 as in the big shapes, one dense and three MoE layers; random weights):

  pack      `moec pack --random smoke-moe --recipe R` (stand-in calibration for every codec), plus
            demo-moe's tokenizer so the CLI can generate;
  static    the static CUDA-graph engine, built as `moec generate` builds it, on a 256-token prompt and
            24 teacher-forced steps (bf16);
  dynamic   the same through the dynamic cache `moec eval` builds (every KV codec);
  generate  `moec generate PACKED --device cuda` on a prompt long enough to fill the compressed history;
  latency   `moec eval PACKED --latency --json` at 1k context: every row timed, none in error (every
            registered KV codec runs in the static engine).

The recipes in MLA_RECIPES run the same checks a second time on `smoke-mla` (DeepSeek-V3 style: multi-head latent
attention with its absorbed decode over the latent cache, sigmoid group routing with the correction bias, a
shared expert, YaRN): one recipe per weight-kernel family (LUT, vq with incoherence, fp8, int4 on every MLA
projection) and the recipes of the MLA latent codec (mla-nuq: kernels/mla_nuq_decode_attention.py), which run on
smoke-mla only (per-head KV codecs are refused on MLA, the latent codec everywhere else). GLM_RECIPES run on
`smoke-glm` (GLM-4.5 style: RoPE on half of each head, q/k/v biases, sigmoid group routing, a shared expert).
OSS_RECIPES run on `smoke-oss` (gpt-oss style: learned sinks, 128-token sliding windows on alternate layers held
in a ring, biases everywhere, the softmax-after-top-k router, biased experts with the clamped SwiGLU; the 2-bit KV
codec on the full-attention layers only).

Recipes with the nuq KV codec run the logit checks three times: by default, with MOEC_KERNELS=tl (the `tl`
decode-attention kernel) and with MOEC_KERNELS=gluon (the Gluon kernel, kernels/gluon_kv_attention.py, wherever
it supports the cache: the default sends these short caches to `tl`, measured faster there): checks
`static`/`dynamic`, `static-tl`/`dynamic-tl` and `static-gluon`/`dynamic-gluon`, each with `gluon_kv_launches`
(how many Gluon launches the check made: > 0 under gluon for a cache it serves, 0 under tl).

The logit checks (pathcheck.compare_paths) measure three paths by the relative L2 distance of their
logits: the default path in bf16 (kernels, graphs), the torch reference in bf16 (MOEC_KERNELS=0) and
the torch reference in fp32 (`exact`). bf16 alone moves logits by a few percent here: 2-bit codes near
a rounding boundary flip under one rounding and not the other, and random weights amplify it. So a
check passes when the default path is no further from fp32 than the bf16 references are, with slack:
rel_l2_exact ≤ 3·floor + 0.01, floor the larger of the two engines' rel_l2_floor (routing near-ties of the
random model flip experts between bf16 and fp32, in either engine's scored steps or in neither).
The factor is measured, not guessed: with codes this coarse two
correct bf16 paths land at different distances from fp32 (which codes flip is chaotic). The static
engine's ternary latent cache (1.6-bit codes) sat at 0.102 against a floor of 0.041 with the fused step
(kernels/fused_decode.py) and at 0.0405 without it (MOEC_FUSE=0), its cache code the same in both
(static vs dynamic cache in fp32: 0.006); ratios up to 2.5 occur in passing records. A wrong slot,
position, rotation or codec field gives distances of 0.35-0.75 here (a compressed cache against fp16).
Greedy tokens are not compared: near-flat random logits make their argmax a coin flip. A default-engine check
that misses its bound is measured once more on a second seeded prompt and passes only there (a near-tie flip is
a property of one prompt, a wrong slot, rotation or codec field shows on any); the record then holds the second
prompt's numbers and the first's under `first_prompt` (2026-12-06: smollm2-mlp-tcq2-had's static path flipped
one of 25 steps, rel_l2_exact 0.064 against a bound of 0.036, while its dynamic path sat at the floor).

Calibration's own kernels run once, outside the recipes (record recipe "(calibration)"): `tcq-viterbi`, the
trellis fit's Viterbi kernel (kernels/tcq_viterbi.py) against the torch search on the GPU at a Mixtral row
count, 2 and 3 bits, which must give the same states bit for bit. Two Gluon kernels are checked directly too
(record recipe "(kernels)"): `gluon-moe-decode-*` (kernels/gluon_moe_decode.py, opt-in under MOEC_KERNELS=gluon;
the recipes' `-gluon` checks count its launches as `gluon_moe_launches`) and `gluon-qlinear-*`
(kernels/gluon_qlinear.py, the default 4-bit decode GEMV, which every attn4 recipe's logit checks also run), and
`fp4h-moe-decode-*`: the fp4 experts' fp16x2 MoE decode kernels (kernels/fp4_h2.py) against the reference, and
`dense-gemv-route-*`: the fused step's bf16 projections through qlinear's GEMV (runtime/decode.py _DenseGEMV) against
cuBLAS in the same engine.

Records (one per check): recipe, check, ok, error, and for logit checks max_abs_err, rel_l2_err, kernel
(whether the default path took the fused kernel), graphs; every record carries `source_tree`, the content
hash of moec/ (scripts/source_tree.sh), which the submitter compares with the landed tree.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
RECIPES = REPO / "moec" / "recipes"
SHAPE = "smoke-moe"
MLA_SHAPE = "smoke-mla"
MLA_RECIPES = ("experts-hls2", "experts-vq3-d2-had", "experts-fp8", "w4a16", "kv-mla-nuq2", "latency-hls2-mla2",
               "latency-hls2-lin4")
GLM_SHAPE = "smoke-glm"
# partial rotary: the fused step's RoPE kernel; lin4 adds the 4-bit shared expert
GLM_RECIPES = ("experts-hls2", "w4a16", "latency-hls2-nuq2", "latency-hls2-nuq2-lin4")
OSS_SHAPE = "smoke-oss"
OSS_RECIPES = ("experts-hls2", "experts-mxfp4", "w4a16", "latency-hls2-nuq2")  # nuq: full layers, rings elsewhere
SLACK_FACTOR, SLACK_ABS = 3.0, 0.01  # rel_l2_exact <= SLACK_FACTOR * rel_l2_floor + SLACK_ABS
PROMPT_TOKENS, STEPS = 256, 24  # prompt > sinks + window + 2 blocks: the history is encoded at prefill
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
PROMPT = ("The committee met on Tuesday to review the budget for the coming year. Members discussed the cost "
          "of new equipment, the salaries of the staff and the plans for a second building near the river. ")


def recipe_file(name: str) -> Path:
    """moec/recipes/NAME.yaml, or moec/recipes/ablations/NAME.yaml."""
    shipped = RECIPES / f"{name}.yaml"
    return shipped if shipped.is_file() else RECIPES / "ablations" / f"{name}.yaml"


def mla_only(name: str) -> bool:
    """A recipe whose KV codec holds the MLA latent (registry `mla`): it runs on MLA_SHAPE only."""
    from moec.calibrate.recipe import load_recipe
    from moec.registry import kv_codec

    kv = load_recipe(str(recipe_file(name))).kv
    return kv is not None and kv_codec(kv.codec).mla


def source_tree() -> str:
    return subprocess.run(["bash", str(REPO / "scripts" / "source_tree.sh")], capture_output=True, text=True,
                          check=True).stdout.strip()


def run_cli(*argv: str) -> tuple[int, str]:
    """`moec ARGV` in this process (moec.cli.app.run: the CLI's own entry point and error handling); (exit
    code, stdout and stderr)."""
    from moec.cli.app import run

    r = run(*argv)
    return r.returncode, r.stdout + r.stderr


def _tail(text: str, n: int = 300) -> str:
    return " ".join(text.split())[-n:]


def check_recipe(name: str, work: Path, tokenizer_dir: Path, device: str = "cuda", shape: str = SHAPE) -> list[dict]:
    from moec.kernels import gluon_kv_attention as gka
    from moec.kernels import gluon_moe_decode as gmd
    from moec.runtime.backend import kernels_forced
    from moec.runtime.loader import load_model
    from moec.runtime.pathcheck import compare_paths

    recs = []
    packed = work / f"{shape}-{name}"

    def record(check: str, t0: float, **kw) -> None:
        recs.append({"recipe": name, "shape": shape, "check": check, "wall_s": round(time.time() - t0, 2)} | kw)

    t0 = time.time()
    rc, out = run_cli("pack", "--random", shape, "--recipe", str(recipe_file(name)), "-o", str(packed))
    record("pack", t0, ok=rc == 0, error=None if rc == 0 else _tail(out))
    if rc != 0:
        return recs
    for f in TOKENIZER_FILES:
        if (tokenizer_dir / f).exists():
            shutil.copy(tokenizer_dir / f, packed / f)

    model, info = load_model(packed, torch.bfloat16, device)
    exact, _ = load_model(packed, torch.float32, device)
    codec = (info.get("kv") or {}).get("codec", "fp16")
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.args.vocab_size, (PROMPT_TOKENS + STEPS,), generator=gen)
    t0 = time.time()
    try:
        n0 = gka.LAUNCHES
        res = compare_paths(model, info.get("kv"), info.get("kv_tensors", {}), ids, PROMPT_TOKENS, exact=exact)
        gluon_launches = gka.LAUNCHES - n0
        # the model's floor: the larger of the two engines' bf16 references' distances from fp32. Both are
        # correct bf16 paths; a random router's near-ties flip experts between bf16 and fp32 (a discrete
        # change of ~9% of the logits on smoke-moe, where the top probabilities can differ by 3e-6), and
        # which path meets such a flip in the scored steps is chance (2026-12-02: smollm2-mlp-hls2-had, the
        # static fused path and the dynamic reference at 0.089, the static reference at 0.009)
        floor = max(r["rel_l2_floor"] for r in res.values())
        runs = [("", res, gluon_launches, 0)]
        if codec == "nuq-outlier":  # the KV kernels' paths forced: `tl`, and Gluon wherever it supports the cache
            for mode in ("tl", "gluon"):  # (the default sends this short cache to tl: gluon_kv_attention.faster)
                with kernels_forced(mode):
                    n0, m0 = gka.LAUNCHES, gmd.LAUNCHES
                    res_mode = compare_paths(model, info.get("kv"), info.get("kv_tensors", {}), ids, PROMPT_TOKENS,
                                             exact=exact)
                runs.append((f"-{mode}", res_mode, gka.LAUNCHES - n0, gmd.LAUNCHES - m0))
        for suffix, rs, launches, moe_launches in runs:
            for engine, r in rs.items():
                bound = SLACK_FACTOR * floor + SLACK_ABS
                ok = r["rel_l2_exact"] <= bound
                first = None
                if not ok and not suffix:
                    # A routing near-tie of the random model flips an expert in one path on one prompt (the
                    # docstring); a wrong slot, rotation or codec field misses on every prompt. So a miss is
                    # measured again on a second seeded prompt, against that prompt's floor, and both are kept.
                    first = {k: r[k] for k in ("rel_l2_exact", "rel_l2_floor", "top1_agree")} | {"bound": bound}
                    ids2 = torch.randint(0, model.args.vocab_size, (PROMPT_TOKENS + STEPS,),
                                         generator=torch.Generator().manual_seed(1))
                    r2 = compare_paths(model, info.get("kv"), info.get("kv_tensors", {}), ids2, PROMPT_TOKENS,
                                       engines=(engine,), exact=exact)[engine]
                    bound = SLACK_FACTOR * max(r2["rel_l2_floor"], floor) + SLACK_ABS
                    r, ok = r2, r2["rel_l2_exact"] <= bound
                recs.append({"recipe": name, "shape": shape, "check": engine + suffix, "ok": ok, "bound": bound,
                             "kv_codec": codec, "gluon_kv_launches": launches, "gluon_moe_launches": moe_launches,
                             "error": None if ok else f"rel_l2_exact {r['rel_l2_exact']:.4g} > bound {bound:.4g}",
                             "wall_s": round(time.time() - t0, 2)} | r | ({"first_prompt": first} if first else {}))
    except Exception as e:
        record("paths", t0, ok=False, error=f"{type(e).__name__}: {e}"[:300], trace=traceback.format_exc()[-1500:])
    del model, exact
    if device == "cuda":
        torch.cuda.empty_cache()

    t0 = time.time()
    rc, out = run_cli("generate", str(packed), "--prompt", PROMPT * 6, "--max-new-tokens", "48", "--device", device,
                      "--no-stop-at-eos")
    tps = None
    for word, nxt in zip(out.split(), out.split()[1:], strict=False):
        if nxt == "tok/s,":
            tps = float(word.strip("("))
    record("generate", t0, ok=rc == 0 and tps is not None, tokens_per_s=tps, error=None if rc == 0 else _tail(out))

    t0 = time.time()
    lat_json = work / f"{name}.latency.json"
    rc, out = run_cli("eval", str(packed), "--latency", "--batches", "1", "--contexts", "1k", "--steps", "10",
                      "--prefill-contexts", "1k", "--json", str(lat_json))
    rows = json.loads(lat_json.read_text()) if lat_json.is_file() else []
    bad = [r.get("error") for r in rows if r.get("error") or (r["bench"] == "moec-latency" and "ms_median" not in r)]
    ok = rc == 0 and rows and not bad
    record("latency", t0, ok=bool(ok), expect="ms/token rows, none in error", kv_codec=codec,
           ms_median=[r.get("ms_median") for r in rows], error=None if ok else (bad[0] if bad else _tail(out)))
    shutil.rmtree(packed, ignore_errors=True)
    return recs


def _checked(name: str, work: Path, tokenizer_dir: Path, device: str, shape: str) -> tuple[list[dict], float]:
    """check_recipe in a worker process; a check that could not even start is a failed record."""
    t0 = time.time()
    try:
        recs = check_recipe(name, work, tokenizer_dir, device, shape)
    except Exception as e:
        recs = [{"recipe": name, "shape": shape, "check": "setup", "ok": False,
                 "error": f"{type(e).__name__}: {e}"[:300],
                 "trace": traceback.format_exc()[-1500:]}]
    return recs, time.time() - t0


def check_calibration_kernels(device: str) -> list[dict]:
    """The calibration kernels against their torch versions on `device` (module docstring); [] on the CPU."""
    if device != "cuda":
        return []
    import os

    from moec.calibrate.tcq import viterbi
    from moec.kernels.tcq_viterbi import viterbi_rows
    from moec.runtime.tcq import code_table

    out = []
    g = torch.Generator(device="cuda").manual_seed(0)
    table = code_table(12).cuda()
    for k in (2, 3):
        t0 = time.time()
        rec = {"recipe": "(calibration)", "check": f"tcq-viterbi-k{k}", "shape": "rows 4096, 40 steps"}
        try:
            x = torch.randn(4096, 40, device="cuda", generator=g) * 1.2
            w = torch.rand(40, device="cuda", generator=g) + 0.3
            start = torch.randint(0, 4096, (4096,), device="cuda", generator=g)
            os.environ["MOEC_TCQ_VITERBI"] = "torch"
            try:
                want = viterbi(x, 12, k, start, table, w)
            finally:
                del os.environ["MOEC_TCQ_VITERBI"]
            got = viterbi_rows(x, table, k, w, start)
            rows_differ = int((got != want).any(1).sum())
            rec |= {"ok": rows_differ == 0, "error": None if rows_differ == 0 else f"{rows_differ} rows differ",
                    "rows_differ": rows_differ}
        except Exception as e:  # recorded: the gate fails, the rest of the smoke still runs
            rec |= {"ok": False, "error": f"{type(e).__name__}: {e}"}
        rec["seconds"] = round(time.time() - t0, 2)
        out.append(rec)
    return out


def _kernel_record(check: str, shape: str, body) -> dict:
    """A "(kernels)" record: body() -> its fields (with "ok" and "error"); an exception fails the record with its
    message; "seconds" is the check's wall time."""
    t0 = time.time()
    rec = {"recipe": "(kernels)", "check": check, "shape": shape}
    try:
        rec |= body()
    except Exception as e:
        rec |= {"ok": False, "error": f"{type(e).__name__}: {e}"[:300]}
    rec["seconds"] = round(time.time() - t0, 2)
    return rec


def check_gluon_moe(device: str) -> list[dict]:
    """The Gluon 2-bit hls MoE decode kernels (kernels/gluon_moe_decode.py, opt-in under MOEC_KERNELS=gluon) against
    moe_decode_ref at small shapes: batch 1 and 3, plain silu and gpt-oss's biased clamped SwiGLU, the down
    kernel's split over programs; max |err| / max |ref| <= 2e-3 (fp16 products, fp32 sums)."""
    if device != "cuda":
        return []
    from moec.kernels import gluon_moe_decode as gmd
    from moec.kernels.dequant import MODE_LUT, QWeight
    from moec.kernels.moe_decode import moe_decode_ref

    g = torch.Generator(device="cuda").manual_seed(0)

    def hls2(E, O, n_in):
        codes = torch.randint(0, 256, (E, O, n_in // 4), dtype=torch.uint8, device="cuda", generator=g)
        lut = (torch.randn(E, O, 1, 4, device="cuda", generator=g).sort(-1).values * 0.05).half()
        return QWeight(MODE_LUT, 2, n_in, codes, lut)

    def case(name: str, shape: str, run) -> dict:
        """run() -> (got, want): the record, max |err| / max |ref| <= 2e-3 (fp16 products, fp32 sums)."""
        def body() -> dict:
            got, want = run()
            err = ((got - want).abs().max() / want.abs().max()).item()
            return {"ok": err <= 2e-3, "max_rel_err": err, "error": None if err <= 2e-3 else f"max_rel_err {err:.3g}"}

        return _kernel_record(name, shape, body)

    out = []
    E, A, D, I = 6, 2, 512, 384  # I: 3 chunks, so the down kernel's masked (uneven) path runs too
    w1, w3, w2 = hls2(E, I, D), hls2(E, I, D), hls2(E, D, I)

    def small(N, act, split):
        x = torch.randn(N, D, device="cuda", generator=g).to(torch.bfloat16)
        ids = torch.stack([torch.randperm(E, device="cuda", generator=g)[:A] for _ in range(N)]).int()
        wts = torch.softmax(torch.randn(N, A, device="cuda", generator=g), -1)
        biases = None
        if act != "silu":
            biases = (torch.randn(E, I, device="cuda", generator=g), torch.randn(E, I, device="cuda", generator=g),
                      torch.randn(E, D, device="cuda", generator=g))
        want = moe_decode_ref(x, ids, wts, w1, w3, w2, biases=biases, act=act)
        return gmd.gluon_moe_decode(x, ids, wts, w1, w3, w2, A, biases=biases, act=act, split=split, block_m_down=16,
                                    warps_down=2), want

    for N, act, split in ((1, "silu", 1), (3, "silu", 2), (3, "clamped_swiglu", 1)):
        out.append(case(f"gluon-moe-decode-n{N}-{act}-split{split}", f"E {E}, top-{A}, {D} -> {I}",
                        lambda N=N, act=act, split=split: small(N, act, split)))

    def allocation_end():
        """The last expert's last rows at the very end of their allocation: 12 MiB of codes a matrix (the caching
        allocator gives a block that size its own segment), the last expert routed. Until 2026-12-06 the loops'
        unmasked prefetch read one chunk past a row, here past the segment: an illegal address (seen on an H100
        with one Mixtral-shaped layer). Best effort: what the driver maps after the segment decides whether such
        a read faults."""
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        E, D, I = 2, 4096, 6144
        w1, w3, w2 = hls2(E, I, D), hls2(E, I, D), hls2(E, D, I)
        x = torch.randn(1, D, device="cuda", generator=g).to(torch.bfloat16)
        ids = torch.tensor([[1, 0]], dtype=torch.int32, device="cuda")
        wts = torch.tensor([[0.7, 0.3]], device="cuda")
        return gmd.gluon_moe_decode(x, ids, wts, w1, w3, w2, 2, split=2), moe_decode_ref(x, ids, wts, w1, w3, w2)

    out.append(case("gluon-moe-decode-allocation-end", "E 2, top-2, 4096 -> 6144", allocation_end))
    return out


def check_gluon_qlinear(device: str) -> list[dict]:
    """The Gluon 4-bit decode GEMV (kernels/gluon_qlinear.py, qlinear's default for 4-bit rtn decode where the
    launch config says gluon4) against qlinear_ref: batch 1 and 3, with a bias, 200 outputs (a partial last block),
    16-row programs of 8 warps, 32-row ones of 4, and 16-row ones of 4 and 16 (gluon_qlinear.pick_warps's other
    choices; 16 warps for 4 chunks a row leave warps without one); max |err| / max |ref| <= 5e-3 (fp16 weights as
    dequantized)."""
    if device != "cuda":
        return []
    from moec.kernels import gluon_qlinear as gq
    from moec.kernels.dequant import MODE_AFFINE, QWeight
    from moec.kernels.qlinear import qlinear_ref

    g = torch.Generator(device="cuda").manual_seed(0)
    K, O, G = 512, 200, 4
    scale = (torch.rand(1, O, G, device="cuda", generator=g) * 0.01 + 1e-3).half()
    w = QWeight(MODE_AFFINE, 4, K, torch.randint(0, 256, (1, O, K // 2), dtype=torch.uint8, device="cuda",
                                                    generator=g), scale, (-8 * scale.float()).half())
    bias = torch.randn(O, device="cuda", generator=g) * 0.1
    def one(M, block_m, warps) -> dict:
        x = torch.randn(M, K, device="cuda", generator=g).to(torch.bfloat16)
        want = qlinear_ref(x, w, bias)
        got = gq.gluon_qlinear(x, w, bias, torch.empty(M, O, dtype=torch.bfloat16, device="cuda"), block_m,
                               warps).float()
        err = ((got - want).abs().max() / want.abs().max()).item()
        return {"ok": err <= 5e-3, "max_rel_err": err, "error": None if err <= 5e-3 else f"max_rel_err {err:.3g}"}

    out = []
    for M, block_m, warps in ((1, 16, 8), (3, 16, 8), (3, 32, 4), (1, 16, 4), (1, 16, 16)):
        out.append(_kernel_record(f"gluon-qlinear-m{M}-bm{block_m}-w{warps}", f"{K} -> {O}, rtn4 g128",
                                  lambda M=M, block_m=block_m, warps=warps: one(M, block_m, warps)))
    return out


def check_fp4h_moe(device: str) -> list[dict]:
    """The fp4 MoE decode kernels with fp16x2 products (kernels/fp4_h2.py; moe_decode takes them for mxfp4 / nvfp4
    experts on sm_89+ where fp4_h2.use_fp4h says) against moe_decode_ref and the fp32
    word path (fp4h=False): mxfp4 with gpt-oss's biased clamped SwiGLU, nvfp4 with silu, batch 1 and 3, the down
    kernel split over programs; max |err| / max |ref| <= 2e-3 (x and h in fp16, fp16 sums over 16 codes), the word
    path <= 1e-4, and the default call gives the fp16x2 path's output where it is on, the word path's where it is off
    (to 1e-5, and at most a tenth of the two paths' distance: the split down GEMV's fp32 atomics are not bit-exact)."""
    if device != "cuda":
        return []
    from moec.kernels import fp4_h2
    from moec.kernels.moe_decode import moe_decode, moe_decode_ref
    from tests.kernels.moe_cases import moe_case

    def one(kind, N, act, split) -> dict:
        x, ids, wts, w1, w3, w2 = moe_case(kind, N, 4, 8, 640, 384, 0, 0, "cuda", seed=N)
        biases = None
        if act != "silu":
            g = torch.Generator(device="cuda").manual_seed(N)
            biases = tuple(torch.randn(8, n, device="cuda", generator=g).to(torch.bfloat16) for n in (384, 384, 640))
        kw = dict(biases=biases, act=act, split=split)
        want = moe_decode_ref(x, ids, wts, w1, w3, w2, biases=biases, act=act)
        got = moe_decode(x, ids, wts, w1, w3, w2, fp4h=True, **kw)
        words = moe_decode(x, ids, wts, w1, w3, w2, fp4h=False, **kw)
        auto = moe_decode(x, ids, wts, w1, w3, w2, **kw)
        scale = want.abs().max()
        err = ((got - want).abs().max() / scale).item()
        err_words = ((words - want).abs().max() / scale).item()
        on = all(fp4_h2.use_fp4h(w) for w in (w1, w3, w2))
        # the default call against the path it should have taken: not bit-exact (the split down GEMV adds with fp32
        # atomics, in no fixed order: an exact test failed all four cases on 2026-12-07), but 10x closer to it than
        # the two paths are to each other
        gap = ((got - words).abs().max() / scale).item()
        err_default = ((auto - (got if on else words)).abs().max() / scale).item()
        default_ok = err_default <= 1e-5 and err_default * 10 <= gap
        ok = err <= 2e-3 and err_words <= 1e-4 and default_ok
        return {"ok": ok, "max_rel_err": err, "max_rel_err_words": err_words, "fp4h_on": on,
                "default_path_ok": default_ok, "default_rel_err": err_default, "paths_rel_gap": gap,
                "error": None if ok else f"max_rel_err {err:.3g} (words {err_words:.3g}), default path off by "
                                          f"{err_default:.3g} (paths {gap:.3g} apart)"}

    return [_kernel_record(f"fp4h-moe-decode-{kind}-n{N}-{act}", "E 8, top-4, 640 -> 384",
                           lambda kind=kind, N=N, act=act, split=split: one(kind, N, act, split))
            for kind, N, act, split in (("mxfp4", 1, "clamped_swiglu", None), ("mxfp4", 3, "clamped_swiglu", 2),
                                        ("nvfp4", 1, "silu", None), ("nvfp4", 3, "silu", 3))]


def check_dense_gemv(device: str) -> list[dict]:
    """The fused step's plain projections through qlinear's GEMV (runtime/decode.py _DenseGEMV, MOEC_DENSE_GEMV=1,
    the router's too with MOEC_DENSE_GEMV_ROUTER=1) against the same engine with cuBLAS: a tiny random glm4_moe
    and deepseek_v3 (q/k/v biases, shared experts, MLA's fused inputs) in bf16 under CUDA graphs, a prefill and 6
    steps; rel L2 of the logits <= 1e-2 (bf16 products summed in another order)."""
    if device != "cuda":
        return []
    from moec.runtime.config import ModelArgs
    from moec.runtime.decode import DecodeEngine, _DenseGEMV
    from moec.runtime.kvcache import dense_cache
    from moec.runtime.latency import random_model

    common = dict(vocab_size=256, dim=256, n_layers=2, n_heads=4, max_seq_len=128, n_experts=4, top_k=2,
                  expert_dim=128, ffn_kinds=["dense", "moe"], dense_dim=256, shared_dim=128, router_score="sigmoid",
                  topk_method="group_top2", n_group=2, topk_group=1, router_bias=True, routed_scale=2.5)
    configs = {"glm4_moe": ModelArgs(arch="glm4_moe", n_kv_heads=2, head_dim=64, qkv_bias=True, **common),
               "deepseek_v3": ModelArgs(arch="deepseek_v3", n_kv_heads=4, head_dim=96, attn_kind="mla",
                                        q_lora_rank=128, kv_lora_rank=64, qk_rope_dim=32, v_head_dim=64, **common)}
    out = []
    for arch, args in configs.items():
        t0 = time.time()
        rec = {"recipe": "(kernels)", "check": f"dense-gemv-route-{arch}", "shape": "tiny random, bf16"}
        old = {k: os.environ.get(k) for k in ("MOEC_DENSE_GEMV", "MOEC_DENSE_GEMV_ROUTER")}
        try:
            logits, routed = [], 0
            for v in ("0", "1"):  # the route with the router on it (whatever the config says) against cuBLAS
                os.environ["MOEC_DENSE_GEMV"] = os.environ["MOEC_DENSE_GEMV_ROUTER"] = v
                model = random_model(args, lambda name: None, "cuda", torch.bfloat16, seed=7)
                eng = DecodeEngine(model, dense_cache(args, 1, 64, dtype=torch.bfloat16, device="cuda",
                                                      mode="static"))
                routed = max(routed, sum(isinstance(m, _DenseGEMV) for m in model.modules()))
                steps = [eng.prefill(0, torch.tensor([3, 9, 27, 17, 51]))]
                steps += [eng.step(1, feed_next=True)[0].clone() for _ in range(6)]
                logits.append(torch.stack(steps).float())
            err = ((logits[1] - logits[0]).norm() / logits[0].norm()).item()
            ok = err <= 1e-2 and routed > 0
            rec |= {"ok": ok, "rel_l2_err": err, "routed_linears": routed,
                    "error": None if ok else f"rel_l2 {err:.3g}, {routed} routed"}
        except Exception as e:
            rec |= {"ok": False, "error": f"{type(e).__name__}: {e}"[:300]}
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        rec["seconds"] = round(time.time() - t0, 2)
        out.append(rec)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "gpu_smoke_h200.json")
    ap.add_argument("--recipes", nargs="*", default=None, help="a subset (default: every shipped recipe)")
    ap.add_argument("--shapes", nargs="*", default=[SHAPE, MLA_SHAPE, GLM_SHAPE, OSS_SHAPE],
                    help=f"{SHAPE} (every recipe), {MLA_SHAPE} (MLA_RECIPES), {GLM_SHAPE} (GLM_RECIPES) and/or "
                    f"{OSS_SHAPE} (OSS_RECIPES)")
    ap.add_argument("--jobs", type=int, default=4, help="worker processes (one GPU; compiles run in parallel)")
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the script itself (torch paths on both "
                    "sides, no latency), for checking it before a GPU call")
    a = ap.parse_args()
    if a.device == "cuda" and not torch.cuda.is_available():
        print("gpu_smoke: needs a CUDA GPU", file=sys.stderr)
        return 2
    from moec.calibrate.recipe import shipped_gpu_recipes
    from moec.calibrate.sources import resolve_model
    from moec.cli.common import base_record, write_json_atomic

    tree = source_tree()
    tokenizer_dir = resolve_model("demo-moe")
    names = a.recipes or shipped_gpu_recipes(RECIPES)
    jobs = [(SHAPE, n) for n in names if SHAPE in a.shapes and not mla_only(n)]
    jobs += [(MLA_SHAPE, n) for n in names if MLA_SHAPE in a.shapes and n in MLA_RECIPES]
    jobs += [(GLM_SHAPE, n) for n in names if GLM_SHAPE in a.shapes and n in GLM_RECIPES]
    jobs += [(OSS_SHAPE, n) for n in names if OSS_SHAPE in a.shapes and n in OSS_RECIPES]
    t_start = time.time()
    records = [base_record("gpu-smoke", a.device) | {"source_tree": tree} | r
               for r in check_calibration_kernels(a.device) + check_gluon_moe(a.device) + check_gluon_qlinear(a.device)
               + check_dense_gemv(a.device) + check_fp4h_moe(a.device)]
    for r in records:
        print(f"[{r['recipe']} {r['check']}] {'ok' if r['ok'] else 'FAILED: ' + str(r['error'])}", flush=True)
    # Triton compiles (CPU-bound) dominate: recipes run in `--jobs` processes on the one GPU
    with tempfile.TemporaryDirectory(prefix="moec-smoke-") as tmp, ProcessPoolExecutor(
            a.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {pool.submit(_checked, name, Path(tmp), tokenizer_dir, a.device, shape): (shape, name)
                   for shape, name in jobs}
        for fut in as_completed(futures):
            (shape, name), (recs, secs) = futures[fut], fut.result()
            for r in recs:
                records.append(base_record("gpu-smoke", a.device) | {"source_tree": tree} | r)
            bad = [r for r in recs if not r["ok"]]
            print(f"[{shape} {name}] {'ok' if not bad else 'FAILED'} in {secs:.1f} s"
                  + "".join(f"\n   {r['check']}: {r['error']}" for r in bad), flush=True)
            records.sort(key=lambda r: (r["recipe"] not in ("(calibration)", "(kernels)"), r["shape"] != SHAPE,
                                        names.index(r["recipe"]) if r["recipe"] in names else -1, r["check"]))
            write_json_atomic(a.out, records)
    n_bad = sum(not r["ok"] for r in records)
    print(f"gpu smoke: {len(records) - n_bad}/{len(records)} checks ok over {len(jobs)} recipe runs in "
          f"{time.time() - t_start:.0f} s; source_tree {tree}; wrote {a.out}")
    return 1 if n_bad else 0


if __name__ == "__main__":
    sys.exit(main())
