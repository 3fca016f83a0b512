"""The vq weight codec (calibrate/vq.py): vector GPTQ, the least-squares refits, its error against the
scalar codebooks at the same rate, the stored layout round trip, bad rules, and calibrate → pack → load."""

import json

import pytest
import torch
from safetensors.torch import load_file

from moec.calibrate import hls, vq
from moec.calibrate.distributed import Dist
from moec.calibrate.pack import pack
from moec.calibrate.recipe import WeightRule, parse_recipe
from moec.calibrate.run import calibrate
from moec.errors import FormatError, UserError
from moec.rotation import rotate, unpack_signs
from moec.runtime.hf_layout import HFCheckpoint
from moec.runtime.loader import check_quant_parts, load_model
from moec.runtime.model import build_model
from moec.runtime.weightcodecs import dequantize_vq, random_vq


def _problem(E=1, O=64, I=128, seed=0):
    """Gaussian rows of varied norms and a correlated, unevenly scaled input second moment."""
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(E, O, I, generator=g) * torch.rand(E, O, 1, generator=g)
    X = torch.randn(E, 2048, I, generator=g) @ (torch.eye(I) + 0.3 * torch.randn(I, I, generator=g) / I**0.5)
    X = X * (0.2 + 2 * torch.rand(E, 1, I, generator=g))
    H = X.transpose(1, 2) @ X / 2048
    return W, H + 0.01 * H.diagonal(dim1=1, dim2=2).mean(-1)[:, None, None] * torch.eye(I)


def test_vq_beats_scalar_codebooks_at_the_same_rate():
    """2 bits per weight: vectors of 4 (256 codewords) against hls' 4 entries per row (GPTQ both), and the
    vector GPTQ against plain nearest-codeword assignment of the same codebook."""
    W, H = _problem()
    err = {}
    for name, st, deq in (("vq", vq.quantize_vq(W, H, 2, 4), vq.fitted_weight),
                          ("hls", hls.quantize(W, H, "hls", 2, 0), lambda s: hls.dequantize("hls", 2, W.shape, s)),
                          ("vq-nogptq", vq.quantize_vq(W, None, 2, 4), vq.fitted_weight)):
        err[name] = hls.output_error(W, deq(st), H).item()
    assert err["vq"] < 0.7 * err["hls"], err
    assert err["vq"] < 0.8 * err["vq-nogptq"], err


def test_vector_gptq_matches_sequential_columns():
    """gptq_assign_vq (blocks of 8 columns, each group's d column steps folded into err·U_BB = w − q) picks
    the same codes as a plain replay: the whole row updated one column at a time, each group's codeword the
    nearest in the metric ‖(w − c)·U_BB⁻¹‖."""
    W, H = _problem(O=16, I=32)
    _, U = hls.gptq_factor(H, act_order=False)
    C = torch.randn(1, 16, 2, generator=torch.Generator().manual_seed(1))
    got = vq.gptq_assign_vq(W, U, C, block=8)
    Wr, U0, C0, want = W[0].clone(), U[0], C[0], []
    for i in range(0, 32, 2):
        Ui = torch.linalg.inv(U0[i : i + 2, i : i + 2])
        k = torch.cdist(Wr[:, i : i + 2] @ Ui, C0 @ Ui).argmin(-1)
        for a in range(2):
            c = i + a
            err = (Wr[:, c] - C0[k, a]) / U0[c, c]
            Wr[:, c:] -= err[:, None] * U0[c, c:][None]
        want.append(k)
    assert torch.equal(got[0], torch.stack(want, -1))


@pytest.mark.parametrize("E", [1, 3])  # 3: one codebook shared by three experts (each under its own H)
def test_refit_codebook_solves_the_least_squares_problem(E):
    W, H = _problem(E=E, O=24, I=32)
    s = W.pow(2).mean(-1).sqrt()
    C0 = torch.randn(1, 16, 2)
    idx = torch.randint(0, 16, (E, 24, 16))
    C = vq.refit_codebook(W, H, s, idx, C0, iters=200)
    # closed form: vec(C) = M⁻¹ b with M = Σ_e Σ_o s_eo² A_eoᵀ H_e A_eo
    A = torch.zeros(E, 24, 32, 32)  # A_eo [I, K·d]: input j·d + a reads entry (idx[e, o, j], a)
    for e in range(E):
        for o in range(24):
            for j in range(16):
                for a in range(2):
                    A[e, o, j * 2 + a, idx[e, o, j] * 2 + a] = 1
    M = torch.einsum("eo,eoik,eij,eojl->kl", s**2, A, H, A)
    b = torch.einsum("eo,eoik,eij,eoj->k", s, A, H, W)
    want = torch.linalg.lstsq(M, b[:, None]).solution[:, 0].view(16, 2)
    used = torch.zeros(16, dtype=torch.bool)
    used[idx.unique()] = True
    torch.testing.assert_close(C[0][used], want[used], rtol=1e-3, atol=1e-3)
    def err(C, s):  # summed over the experts that share C
        return hls.output_error(W, vq.reconstruct(C, s, idx), H).sum()

    assert err(C, s) < err(C0, s)
    assert err(C, vq.refit_scales(W, H, C, idx, s)) <= err(C, s)


def test_shared_codebook_fit():
    """One codebook [1, K, d] for four experts: stored layout, the reconstruction the runtime computes, and an
    error no worse than the best shared codebook one expert's own fit offers (each expert's codebook is a
    candidate the pooled fit could have kept)."""
    W, H = _problem(E=4, O=16, I=64)
    rule = WeightRule(targets=["experts"], codec="vq", bits=2, group_size=4, shared_codebook=True)
    st = vq.quantize_vq_rule(W, H, rule)
    assert st["codebook"].shape == (1, 256, 4) and st["row_scale"].shape == (4, 16)
    ref = vq.quantize_vq(W, H, 2, 4, shared=True)
    shared_err = hls.output_error(W, vq.fitted_weight(ref), H).sum()
    assert torch.equal(dequantize_vq(2, W.shape, st), vq.fitted_weight(ref))
    own = vq.quantize_vq(W, H, 2, 4)
    _, U = hls.gptq_factor(H.float(), act_order=False)
    borrowed = []
    for e in range(4):  # expert e's codebook for every expert, codes and scales refitted to it
        C = own["codebook"][e : e + 1].float()
        s = own["row_scale"].float()
        idx = vq.gptq_assign_vq(W / s[..., None], U, C.expand(4, -1, -1))
        s = vq.refit_scales(W, H, C, idx, s)
        borrowed.append(hls.output_error(W, vq.reconstruct(C, s, idx), H).sum())
    assert shared_err < min(borrowed), (shared_err, borrowed)


@pytest.mark.parametrize("bits,d", [(2, 4), (3, 2), (2, 2), (3, 4), (2, 1)])
def test_stored_layout_round_trip(bits, d):
    W, H = _problem(E=2, O=8, I=48)
    rule = WeightRule(targets=["experts"], codec="vq", bits=bits, group_size=d)
    st = vq.quantize_vq_rule(W, H, rule)
    ref = vq.quantize_vq(W, H, bits, d)
    assert st["codes"].dtype == torch.uint8 and st["codes"].shape == (2, 8, -(-48 // d * bits * d // 8))
    assert st["codebook"].shape == (2, 1 << (bits * d), d) and st["row_scale"].shape == (2, 8)
    assert torch.equal(dequantize_vq(bits, W.shape, st), vq.fitted_weight(ref))
    stand_in = random_vq(bits, W.shape, d, "cpu", torch.Generator().manual_seed(0))
    assert {k: (v.shape, v.dtype) for k, v in stand_in.items()} == {k: (v.shape, v.dtype) for k, v in st.items()}


@pytest.mark.parametrize("bits,d,msg", [(2, 3, "group_size must be one of"), (4, 4, "at most 12 bits per code"),
                                         (2, 0, "group_size must be one of")])
def test_bad_vq_rules(bits, d, msg):
    with pytest.raises(UserError, match=msg):
        WeightRule(targets=["experts"], codec="vq", bits=bits, group_size=d)


def test_shared_codebook_needs_a_codebook_to_share():
    with pytest.raises(UserError, match="codec 'hls' has none to share.*vq"):
        WeightRule(targets=["experts"], codec="hls", bits=2, shared_codebook=True)


@pytest.mark.parametrize("shared", [False, True])
def test_vq_pipeline(tiny_moe_dir, tmp_path, shared):
    """calibrate (with incoherence and a few tuning steps) → pack → load: the loaded model computes the
    source model with each expert matrix replaced by its stored vq reconstruction (rotation undone).
    shared: one codebook per layer's matrix, stored [1, K, d]; a manifest's codebook of another leading size
    is refused."""
    calib, packed = tmp_path / "calib", tmp_path / "packed"
    rules = [{"targets": ["experts"], "codec": "vq", "bits": 2, "group_size": 4, "incoherence": {"block": 8},
              "shared_codebook": shared}]
    recipe = parse_recipe({"name": "vq", "weights": rules,
                           "calibration": {"expert_policy": "all-experts-for-stats", "min_expert_tokens": 0,
                                           "tune_steps": 3, "tune_batch": 2}})
    calibrate(tiny_moe_dir, "tiny", recipe, "ptb", "valid", 4, 64, 0, calib)
    pack(tiny_moe_dir, "tiny", calib, packed)
    fitted = load_file(str(calib / "calib.safetensors"))
    stored = {}
    for f in packed.glob("model-*.safetensors"):
        stored.update(load_file(str(f)))
    man = json.loads((packed / "moec.json").read_text())
    src = HFCheckpoint(tiny_moe_dir).state_dict()
    for layer in (0, 1):
        for m in ("w1", "w3", "w2"):
            name = f"layers.{layer}.moe.{m}"
            parts = {k.removeprefix(name + "."): v for k, v in stored.items() if k.startswith(name + ".")}
            assert set(parts) == {"codes", "codebook", "row_scale", "had_signs"}
            for k, v in parts.items():
                assert torch.equal(v, fitted[f"fit.{name}.{k}"]), (name, k)
            assert man["tensors"][f"{name}.codebook"]["codec"] == "vq"
            assert parts["codebook"].shape[0] == (1 if shared else src[name].shape[0])
            signs = unpack_signs(parts.pop("had_signs"), src[name].shape[-1])
            src[name] = rotate(dequantize_vq(2, tuple(src[name].shape), parts), signs, inverse=True)
    tuned = json.loads((calib / "report.json").read_text())["tune"]
    assert tuned["codecs"] == ["vq"] and tuned["steps_run"] == 3
    model, _ = load_model(packed)
    ref = build_model(model.args, src, dtype=torch.float32)
    x = torch.randint(0, model.args.vocab_size, (2, 24))
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref(x), rtol=1e-4, atol=1e-4)
        # the CPU reference dequantizes one expert at a time: expert e alone == row e of all experts
        q = model.layers[0].moe.codec.w2
        torch.testing.assert_close(q.dequant_ref(1), q.dequant_ref()[1], rtol=0, atol=0)
    if shared:  # a codebook for two of the five experts is neither shared nor one per expert
        man_bad = json.loads(json.dumps(man))
        man_bad["tensors"]["layers.0.moe.w2.codebook"]["shape"][0] = 2
        check_quant_parts(packed, man)  # (the shards' own shapes are checked against the manifest first)
        with pytest.raises(FormatError, match=r"w2 \(vq, 2 bits\): part 'codebook' is float16 \[2, 256, 4\]"):
            check_quant_parts(packed, man_bad)
    # a manifest whose vq group_size is not a vector length is a FormatError, not a traceback
    for bad in (0, 3):
        man_bad = json.loads(json.dumps(man))
        for e in man_bad["tensors"].values():
            if e.get("param") == "layers.0.moe.w2":
                e["group_size"] = bad
        (packed / "moec.json").write_text(json.dumps(man_bad))
        with pytest.raises(FormatError, match="group_size"):
            load_model(packed)


def test_shared_codebook_refused_expert_parallel(tiny_moe_dir, tmp_path):
    """Expert-parallel ranks each fit a share of the experts; a shared codebook needs them all in one fit."""
    rules = [{"targets": ["experts"], "codec": "vq", "bits": 2, "group_size": 4, "shared_codebook": True}]
    recipe = parse_recipe({"name": "vq-shared", "weights": rules})
    with pytest.raises(UserError, match="shared_codebook fits one codebook from every expert.*one process"):
        calibrate(tiny_moe_dir, "tiny", recipe, "ptb", "valid", 4, 64, 0, tmp_path / "calib",
                  dist=Dist(grouped=True))
    assert not (tmp_path / "calib").exists()


def test_random_pack_stores_the_shared_layout(tmp_path):
    """`moec pack --random` with a shared-codebook recipe stores one codebook per matrix, as calibration does (the
    GPU smoke and the latency models run that layout), and the model loads with it held per expert."""
    from moec.calibrate.pack import pack_random
    from moec.calibrate.recipe import load_recipe
    from moec.formats import checkpoint
    from moec.runtime.config import ModelArgs

    args = ModelArgs(arch="mixtral", vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                     max_seq_len=128, n_experts=4, top_k=2, expert_dim=16)
    pack_random(args, "tiny", load_recipe("moec/recipes/experts-vq2-d4-had-shared.yaml"), tmp_path / "ck")
    man = json.loads((tmp_path / "ck" / checkpoint.MANIFEST).read_text())
    assert man["tensors"]["layers.1.moe.w2.codebook"]["shape"] == [1, 256, 4]
    model, _ = load_model(tmp_path / "ck")
    w2 = model.layers[1].moe.codec.w2
    assert w2.codebook.shape == (4, 256, 4) and torch.equal(w2.codebook[0], w2.codebook[3])
