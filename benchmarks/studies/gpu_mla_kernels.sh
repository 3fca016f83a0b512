#!/usr/bin/env bash
# Issue 35's latent-kernel studies in one GPU call (prepared 2026-12-06): the Gluon history kernel for the mla-nuq
# cache (gluon_mla_nuq.py: checked against torch, timed beside the `tl` and fp16 kernels), the `tl` kernel's
# variants (mla_nuq_variants.py: planes kept, cubic levels), and the fp16 latent kernel over the many-heads grid
# (mla_nuq_heads_sweep.py --fp16; no --write, so moec/ is untouched and the smoke record stays valid).
# Outputs: three JSON files and one log archive in OUT_DIR (the call's 8-file limit).
# Usage, from the repo root:  bash benchmarks/studies/gpu_mla_kernels.sh OUT_DIR        (~4 min on one H100)
set -u
cd "$(dirname "$0")/../.."
OUT=${1:?usage: gpu_mla_kernels.sh OUT_DIR}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD MOEC_LOG=${MOEC_LOG:-WARNING}
T0=$SECONDS
timeout 200 python3 -m benchmarks.studies.gluon_mla_nuq --out "$OUT/gluon_mla_nuq.json" > "$OUT/gluon.log" 2>&1
echo "gluon_mla_nuq rc=$? at $((SECONDS - T0)) s"; tail -4 "$OUT/gluon.log"
timeout 150 python3 -m benchmarks.studies.mla_nuq_variants --out "$OUT/mla_nuq_variants.json" > "$OUT/variants.log" 2>&1
echo "variants rc=$? at $((SECONDS - T0)) s"; tail -4 "$OUT/variants.log"
timeout 150 python3 -m benchmarks.studies.mla_nuq_heads_sweep --fp16 --out "$OUT/mla_heads_fp16.json" \
  > "$OUT/heads.log" 2>&1
echo "heads sweep rc=$? at $((SECONDS - T0)) s"; tail -2 "$OUT/heads.log"
(cd "$OUT" && tar czf logs.tgz ./*.log && rm -f ./*.log)
