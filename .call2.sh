export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 200 python3 -m pytest -q -x tests/kernels/test_route_topk.py tests/kernels/test_kv_decode_attention.py tests/kernels/test_moe_decode.py 2>&1 | tail -4
timeout 300 python3 benchmarks/bench_latency.py --out $OUT/latency_quick2.json --quick --budget 150 > $OUT/latency2.log 2>&1; echo latency rc=$?
python3 - <<'PY'
import json, os
d = json.load(open(os.environ["OUT"] + "/latency_quick2.json"))
for r in d:
    if r["bench"] == "moec-latency":
        print(r["shape"][:7], r["recipe"], r["batch"], r["context"], round(r.get("ms_median", 0), 2), r.get("error", ""))
    elif r["bench"] == "moec-latency-breakdown":
        print("BREAKDOWN", r["shape"], r["recipe"], {k: round(v, 3) for k, v in r.get("ms_by_group", {}).items()})
        for k in r.get("kernels_over_1pct", [])[:8]:
            print("     ", round(k["ms"], 3), k["kernel"][:50], k.get("pct_of_copy"))
    elif "prefill" in r["bench"]:
        print("PREFILL", r["shape"], r["recipe"], r.get("prefill_s"), r.get("prefill_warmup_s"))
PY
