"""Does moec read deepseek2 and gpt-oss GGUFs as llama.cpp runs them? (issue 34)

moec's CI test (tests/calibrate/test_gguf_generic.py) writes tiny files with its own writer
(tests/calibrate/gguf_files.py) and reads them back: that proves the reader inverts the writer, not that
the writer stores what llama.cpp's converter stores. Here llama.cpp itself (llama-cpp-python, built from its
sdist as for benchmarks/export_llamacpp_check.py) runs the same files, and its logits are compared with the
transformers model moec reads from the file (and with the source model, which holds the file's tensors):
if the writer misplaced a tensor, llama.cpp would compute another function.

Cases: DeepSeek-V3-style (sigmoid routing, groups, MLA split k_b/v_b, YaRN), DeepSeek-V2-style (softmax,
legacy kv_b, no groups), gpt-oss (MXFP4 experts, sinks, sliding window 8 over 24 tokens, YaRN). For gpt-oss
also the source model with HF's `truncate: True` YaRN, to size the one difference the module docstring of
moec/calibrate/gguf_generic.py predicts (llama.cpp floors and ceils YaRN's correction range).

    python3 -m benchmarks.studies.gguf_read_llamacpp [--out benchmarks/results/gguf_read_llamacpp.json]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import numpy as np
import torch
import transformers as T

from benchmarks.benchutil import ROOT
from moec.cli.common import base_record, write_json_atomic


def _kl(ref: np.ndarray, got: np.ndarray) -> float:
    lp_r = ref - np.logaddexp.reduce(ref, -1, keepdims=True)
    lp_g = got - np.logaddexp.reduce(got, -1, keepdims=True)
    return float((np.exp(lp_r) * (lp_r - lp_g)).sum(-1).mean())


def main() -> None:
    import llama_cpp

    from moec.calibrate.sources import resolve_model
    from tests.calibrate.gguf_files import F32, MXFP4, Q8, tiny_model, write_deepseek2, write_gpt_oss

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "gguf_read_llamacpp.json")
    ap.add_argument("--tokens", type=int, default=24)
    a = ap.parse_args()
    torch.manual_seed(0)
    ids = torch.randint(1, 8192, (a.tokens,), generator=torch.Generator().manual_seed(1)).tolist()
    yarn = {"factor": 4.0, "original": 128, "mscale_all_dim": 0.707}
    rope_ds = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "beta_fast": 32.0,
               "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 0.707, "rope_theta": 10000.0}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["MOEC_CACHE"] = str(Path(tmp) / "cache")
        cases = {
            "deepseek_v3 MLA k_b/v_b, sigmoid, 4 groups, YaRN": (
                lambda: tiny_model("deepseek_v3", rope_parameters=rope_ds),
                lambda p, m, q: write_deepseek2(p, m, mla=True, yarn=yarn, expert_qtype=q, tokenizer=True)),
            "deepseek_v2 legacy kv_b, softmax greedy": (
                lambda: tiny_model("deepseek_v2", topk_method="greedy", n_group=None, topk_group=None),
                lambda p, m, q: write_deepseek2(p, m, mla=False, expert_qtype=q, tokenizer=True)),
            "gpt_oss sinks, window 8, YaRN": (
                lambda: tiny_model("gpt_oss"), lambda p, m, q: write_gpt_oss(p, m, expert_qtype=q, tokenizer=True)),
        }
        # "f32": every tensor and llama.cpp's KV cache in fp32, so a difference is a misread, not rounding;
        # "shipped": experts quantized (Q8_0; MXFP4 for gpt-oss) and llama.cpp's default f16 cache
        for (name, (make, write)), mode in [(c, m) for c in cases.items() for m in ("f32", "shipped")]:
            model = make()
            path = Path(tmp) / f"{name.split()[0]}-{mode}.gguf"
            shipped = MXFP4 if name.startswith("gpt_oss") else Q8
            write(path, model, F32 if mode == "f32" else shipped)  # the model now holds the file's tensors
            read = T.AutoModelForCausalLM.from_pretrained(resolve_model(str(path)), dtype=torch.float32).eval()
            with torch.no_grad():
                src = model(torch.tensor([ids])).logits[0].double().numpy()
                moec = read(torch.tensor([ids])).logits[0].double().numpy()
            cache = {"type_k": 0, "type_v": 0} if mode == "f32" else {}  # 0: GGML_TYPE_F32
            llm = llama_cpp.Llama(model_path=str(path), n_ctx=64, logits_all=True, n_threads=2, verbose=False,
                                  **cache)
            llm.eval(ids)
            lc = np.asarray(llm.scores[: len(ids)], dtype=np.float64)
            row = {"case": name, "mode": mode, "tokens": len(ids), "vocab": int(src.shape[-1]),
                   "moec_vs_source_max_abs": float(np.abs(moec - src).max()),
                   "llama_cpp_vs_moec_max_abs": float(np.abs(lc - moec).max()),
                   "llama_cpp_vs_moec_kl_mean": _kl(moec, lc),
                   "logit_scale": float(np.abs(moec).max()),
                   "top1_agree": float((lc.argmax(-1) == moec.argmax(-1)).mean())}
            if name.startswith("gpt_oss"):  # HF's yarn with llama.cpp's floor/ceil of the correction range
                trunc = make()
                trunc.load_state_dict(model.state_dict())
                trunc.config.rope_parameters = dict(model.config.rope_parameters, truncate=True)
                trunc.model.rotary_emb = type(trunc.model.rotary_emb)(config=trunc.config)
                with torch.no_grad():
                    tr = trunc(torch.tensor([ids])).logits[0].double().numpy()
                row["llama_cpp_vs_source_truncate_true_max_abs"] = float(np.abs(lc - tr).max())
                row["llama_cpp_vs_source_truncate_true_kl_mean"] = _kl(tr, lc)
            print(json.dumps(row), flush=True)
            rows.append(row)
            del llm
    rec = base_record("gguf_read_llamacpp", "cpu") | {"llama_cpp": llama_cpp.__version__, "rows": rows}
    write_json_atomic(a.out, rec)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
