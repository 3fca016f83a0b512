"""benchmarks/studies/gluon_mla_nuq.py's Gluon kernel (prepared for a GPU call, built on gluon_kv_attention_wg's
operand maps) still compiles for sm_90 after changes to those maps: one compile in a fresh process
(aot.report_in_subprocess), its registers without spills and its history loop doing the tensor-core work the
design says (5 key chunks and 4 value chunks a tile). Its numbers come from the GPU (gpu_mla_kernels.sh)."""

from collections import Counter

from moec.kernels import aot

TYPES = {"q_ptr": "*fp32", "codes_ptr": "*i32", "scale_ptr": "*fp16", "lev_ptr": "*fp32", "hist_ptr": "*i32",
         "part_ptr": "*fp32"} | {n: "i32" for n in ("H", "HC", "n_splits", "sq_b", "sq_h")}


def test_gluon_mla_history_kernel_compiles_without_spills():
    T, N = 16, 16
    rep = aot.report_in_subprocess([{"module": "benchmarks.studies.gluon_mla_nuq", "kernel": "_gluon_mla_hist_kernel",
                                     "types": TYPES, "constexprs": {"T": T, "N": N, "LAZY": True}, "num_warps": 4,
                                     "loop_marker": "HMMA"}])[0]
    res, loop = rep["resources"], Counter(rep["loop"])
    assert res["registers"] <= 255 and res["local"] == 0 and res["stack"] == 0, res
    # per warp and tile: keys 5 chunks x (T/16 m-tiles x N/8 n-tiles x 2 k-steps), values 4 x (2 x N/8 x T/16)
    assert loop["HMMA"] == 5 * (T // 16) * (N // 8) * 2 + 4 * 2 * (N // 8) * (T // 16), loop
    assert loop["LDL"] == loop["STL"] == 0, loop
