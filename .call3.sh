export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
t0=$SECONDS
timeout 330 python3 benchmarks/bench_latency.py --out $OUT/latency_h200.json --budget 250 > $OUT/latency.log 2>&1; echo latency rc=$? $((SECONDS-t0))s
timeout 90 python3 benchmarks/bench_memory_estimate.py --model demo-moe --recipe recipes/experts-hls2.yaml --ids benchmarks/data/demo-moe_ptb_ids.pt --samples 512 --seq-len 512 --device cuda --out $OUT/memory_estimate_gpu.json > $OUT/mem.log 2>&1; echo mem rc=$? $((SECONDS-t0))s; tail -3 $OUT/mem.log
timeout 120 python3 benchmarks/bench_nuq_attention.py --out $OUT/nuq_attention_h200.json > $OUT/nuq.log 2>&1; echo nuq rc=$? $((SECONDS-t0))s; tail -12 $OUT/nuq.log
python3 - <<'PY'
import json, os
d = json.load(open(os.environ["OUT"] + "/latency_h200.json"))
for r in d:
    if r["bench"] == "moec-latency":
        print(r["shape"][:7], r["recipe"], r["batch"], r["context"], round(r.get("ms_median", 0), 2), round(r.get("floor_ms", 0), 2), r.get("error", ""))
    elif r["bench"] == "moec-latency-breakdown":
        print("BREAKDOWN", r["shape"], r["recipe"], {k: round(v, 3) for k, v in r.get("ms_by_group", {}).items()})
        for k in r.get("kernels_over_1pct", [])[:10]:
            print("     ", round(k["ms"], 3), k["kernel"][:50], k.get("calls_per_step"), k.get("pct_of_copy"))
    elif "prefill" in r["bench"]:
        print("PREFILL", r["shape"], r["recipe"], r["context"], r.get("prefill_s"), r.get("prefill_warmup_s"), r.get("error", ""))
PY
