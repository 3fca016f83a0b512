"""One cache per codec family (moec/runtime/kvcache.py): the dynamic, static and simulated modes of one family
write byte-identical packed history for the same keys/values, because every mode ages its window through the
one TieredKVCache._age (and the RVQ archive through RVQTieredCache._aged). Checked on the stored fields
themselves (codes, scales, outliers; the latent group codes; the RVQ middle and archive codes). Also: the
simulated mode's one forward gives every query the attention output dynamic decode gives it."""

import pytest
import torch

from moec.rotation import block_hadamard
from moec.runtime.config import ModelArgs
from moec.runtime.kvtiered import TieredKVCache
from moec.runtime.latent import LatentCodec, LatentKVCache
from moec.runtime.nuq import FIXED_LEVELS, NUQCenteredCodec, NUQOutlierCodec
from moec.runtime.rvq import RVQLayerCodec, RVQTier, RVQTieredCache

ARGS = ModelArgs(arch="llama", vocab_size=8, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32,
                 max_seq_len=256)
B, S = 2, 100  # rows, tokens
TIERS = dict(window=16, sinks=2, block=16)  # blocks_at(100) = (100 - 2 - 16) // 16 = 5 history blocks


def _nuq(rotated: bool) -> list:
    gen = torch.Generator().manual_seed(1)
    K, d, lev = ARGS.n_kv_heads, ARGS.head_dim, torch.tensor(FIXED_LEVELS[2])
    if not rotated:
        return [NUQOutlierCodec(2, d, 16, lev, lev * 0.8, torch.rand(K, d, generator=gen) + 0.5, 0.02)
                for _ in range(ARGS.n_layers)]
    return [NUQCenteredCodec(2, d, 16, lev, lev, torch.rand(K, d, generator=gen) + 1, 0.02,
                             k_center=0.1 * torch.randn(K, d, generator=gen), rotation=block_hadamard(d, seed=i))
            for i in range(ARGS.n_layers)]


def _qkv(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, ARGS.n_heads, S, ARGS.head_dim, generator=gen)
    kv = [(torch.randn(B, ARGS.n_kv_heads, S, ARGS.head_dim, generator=gen) * 2,
           torch.randn(B, ARGS.n_kv_heads, S, ARGS.head_dim, generator=gen)) for _ in range(ARGS.n_layers)]
    return q, kv


def _run(cache, prefill: int, seed: int = 0):
    """Feed the same q, k, v [.., S, ..] through `cache` in its mode: dynamic (a prefill call, then one token per
    call), static (prefill_row per row and layer, then one engine step per token: pos, attend, after_step) or
    simulated (one forward over the whole window)."""
    q, kv = _qkv(seed)
    L = ARGS.n_layers
    cache.outputs = outs = [[] for _ in range(L)]  # dynamic / simulated: attention outputs per layer [B, H, S, d]
    with torch.no_grad():
        if cache.mode == "simulated":
            for layer in range(L):
                outs[layer].append(cache.attend(layer, q, kv[layer][0], kv[layer][1], 0))
        elif cache.mode == "dynamic":
            for layer in range(L):
                outs[layer].append(cache.attend(layer, q[:, :, :prefill], kv[layer][0][:, :, :prefill],
                                                kv[layer][1][:, :, :prefill], 0))
            for t in range(prefill, S):
                for layer in range(L):
                    sl = slice(t, t + 1)
                    outs[layer].append(cache.attend(layer, q[:, :, sl], kv[layer][0][:, :, sl], kv[layer][1][:, :, sl],
                                                    t))
        else:
            cache.pos = torch.zeros(B, dtype=torch.long)
            for r in range(B):
                for layer in range(L):
                    cache.prefill_row(r, layer, kv[layer][0][r, :, :prefill], kv[layer][1][r, :, :prefill])
                cache.set_length(r, prefill)
            for t in range(prefill, S):
                cache.pos.fill_(t)
                for layer in range(L):
                    sl = slice(t, t + 1)
                    cache.attend(layer, q[:, :, sl], kv[layer][0][:, :, sl], kv[layer][1][:, :, sl], 0)
                cache.after_step(range(B))
    cache.outputs = [torch.cat(o, dim=2) if o else None for o in outs]
    return cache


def _same_attention(dyn, sim) -> None:
    """Simulated mode gives every query the view dynamic decode gives it: equal outputs up to summation order."""
    for layer, (a, b) in enumerate(zip(dyn.outputs, sim.outputs, strict=True)):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-4), (layer, (a - b).abs().max())


def _equal(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), (what, a.keys(), b.keys())
    for name in a:
        x, y = a[name], b[name]
        assert x.shape == y.shape and x.dtype == y.dtype, (what, name, x.shape, y.shape)
        assert torch.equal(x.view(torch.uint8) if x.dtype.is_floating_point else x,
                           y.view(torch.uint8) if y.dtype.is_floating_point else y), (what, name)


def _tiered_fields(cache, nb: int) -> dict:
    return {f"{kind}{layer}.{n}": t for kind in "kv" for layer in range(ARGS.n_layers)
            for n, t in cache.store.fields(layer, kind, nb).items()}


@pytest.mark.parametrize("rope_pre", [False, True])
@pytest.mark.parametrize("rotated", [False, True])
@pytest.mark.parametrize("prefill", [6, 60])
def test_tiered_modes_write_identical_history(rope_pre, rotated, prefill):
    """nuq-outlier (post-/pre-RoPE keys, with and without the head_dim rotation): the three modes store the same
    bytes; a 60-token prompt puts blocks into the history at prefill (the static mode encodes them at once)."""
    codecs = _nuq(rotated)
    nb = 5
    caches = {mode: _run(TieredKVCache(ARGS, B, S, codecs, rope_pre=rope_pre, use_kernel=False, mode=mode,
                                       **TIERS), prefill)
              for mode in ("dynamic", "static", "simulated")}
    assert caches["dynamic"].n_blocks == [nb] * ARGS.n_layers and caches["static"].n_blocks == [nb] * B
    assert caches["simulated"].n_blocks == [nb] * ARGS.n_layers
    ref = _tiered_fields(caches["dynamic"], nb)
    assert ref["k0.codes"].any() and ref["k1.out_val"].any()  # the history was written
    for mode in ("static", "simulated"):
        _equal(ref, _tiered_fields(caches[mode], nb), mode)
    if prefill < 2 + 16 + 16:  # the prefill evicts nothing: simulated mode is exact
        _same_attention(caches["dynamic"], caches["simulated"])
    # the fp16 windows hold the same tokens: dynamic [B, K, n, d]; static slots [0, n) of every row
    for kind in "kv":
        for layer in range(ARGS.n_layers):
            w = caches["dynamic"].win[kind][layer]
            assert torch.equal(w, caches["static"].win[kind][layer][:, :, : w.shape[2]]), (kind, layer)


def test_fp8_modes_write_identical_history():
    """The fp8 KV codec with no window and no sinks (recipe kv-fp8): every full block leaves at once, and the three
    modes store the same bytes."""
    from moec.runtime.fp8kv import FP8KVCodec

    codecs = [FP8KVCodec(ARGS.head_dim, torch.tensor([0.01 * (i + 1)]), torch.tensor([0.005])) for i in range(2)]
    tiers = dict(window=0, sinks=0, block=16, prefill=6)
    nb = S // 16
    caches = {mode: _run(TieredKVCache(ARGS, B, S, codecs, use_kernel=False, mode=mode, **tiers), 6)
              for mode in ("dynamic", "static", "simulated")}
    assert caches["dynamic"].n_blocks == [nb] * ARGS.n_layers and caches["static"].n_blocks == [nb] * B
    ref = _tiered_fields(caches["dynamic"], nb)
    assert ref["k0.codes"].any()
    for mode in ("static", "simulated"):
        _equal(ref, _tiered_fields(caches[mode], nb), mode)


def _latent_codecs(groups):
    K, d = ARGS.n_kv_heads, ARGS.head_dim
    out = []
    for g, layers in enumerate(groups):
        D = len(layers) * K * d
        gen = torch.Generator().manual_seed(g)
        basis = torch.linalg.qr(torch.randn(D, D, generator=gen))[0][:, : D // 4].contiguous()
        out.append({kind: LatentCodec(basis, torch.randn(D, generator=gen) * 0.1, torch.full((D // 4,), 3.0), 2,
                                      16, 0.01) for kind in "kv"})
    return out


@pytest.mark.parametrize("group_layers", [1, 2])
@pytest.mark.parametrize("rope_pre", [False, True])
def test_latent_modes_write_identical_history(group_layers, rope_pre):
    """latent-head (groups of 1 layer) and latent-layer (2 layers share a basis): dynamic and static modes store
    the same group codes and outliers (the latent family has no simulated mode)."""
    groups = [list(range(i, min(i + group_layers, ARGS.n_layers))) for i in range(0, ARGS.n_layers, group_layers)]
    codecs = _latent_codecs(groups)
    caches = {mode: _run(LatentKVCache(ARGS, B, S, groups, codecs, rope_pre=rope_pre, use_kernel=False, mode=mode,
                                       **TIERS), 6) for mode in ("dynamic", "static")}
    assert caches["dynamic"].n_blocks == [5] * ARGS.n_layers and caches["static"].n_blocks == [5] * B
    for g in range(len(groups)):
        for kind in "kv":
            ref = caches["dynamic"].group_fields(g, kind, 5)
            assert ref["codes"].any()
            _equal(ref, {n: t[:, : ref[n].shape[1]] for n, t in caches["static"].lhist[g][kind].items()},
                   f"static g{g} {kind}")


def _rvq_codecs():
    gen = torch.Generator().manual_seed(3)
    K, d = ARGS.n_kv_heads, ARGS.head_dim
    tier = lambda sizes: RVQTier([torch.randn(K, d // 4, c, 4, generator=gen) for c in sizes])  # noqa: E731
    return [RVQLayerCodec({"k": tier([32, 16]), "v": tier([32, 16])}, {"k": tier([64]), "v": tier([64])})
            for _ in range(ARGS.n_layers)]


@pytest.mark.parametrize("rope_pre", [False, True])
def test_rvq_modes_write_identical_history(rope_pre):
    """rvq-tiered: the middle tier and the archive (blocks re-encoded once ≥ archive_after tokens back) hold the
    same bytes in the three modes."""
    codecs = _rvq_codecs()
    caches = {mode: _run(RVQTieredCache(ARGS, B, S, codecs, archive_after=48, rope_pre=rope_pre, use_kernel=False,
                                        mode=mode, **TIERS), 6)
              for mode in ("dynamic", "static", "simulated")}
    na = caches["dynamic"].arch_at(S)  # (100 - 48 - 2) // 16 = 3 archived of 5 blocks
    assert na == 3 and caches["dynamic"].n_arch == [na] * ARGS.n_layers and caches["static"].n_arch == [na] * B
    assert caches["simulated"].n_arch == [na] * ARGS.n_layers
    for layer in range(ARGS.n_layers):
        for kind in "kv":
            ref = {"mid": caches["dynamic"].hist[kind][layer]["codes"][:, :, : 5 * 16],
                   "arch": caches["dynamic"].arch[kind][layer][:, :, : na * 16]}
            assert ref["arch"].any()
            for mode in ("static", "simulated"):
                c = caches[mode]
                _equal(ref, {"mid": c.hist[kind][layer]["codes"][:, :, : 5 * 16],
                             "arch": c.arch[kind][layer][:, :, : na * 16]}, f"{mode} {kind}{layer}")
    _same_attention(caches["dynamic"], caches["simulated"])


def test_one_cache_class_per_codec_family():
    """KV-cache classes in moec/ outside moec/hf/ (by the AST: classes whose methods, inherited ones included,
    have `attend` and a byte count): one per codec family, the modes being modes of it, and the layer-split
    composite (sliding-window layers in FP16Cache rings, the others in a tiered family's cache)."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "moec"
    classes = {}  # name -> (module, base names, method names)
    for path in root.rglob("*.py"):
        if "hf" in path.relative_to(root).parts[:1]:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                methods = {n.name for n in node.body if isinstance(n, ast.FunctionDef)}
                bases = [b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases]
                classes[node.name] = (path.relative_to(root).as_posix(), bases, methods)

    def methods(name: str) -> set[str]:
        _, bases, own = classes[name]
        return own.union(*(methods(b) for b in bases if b in classes))

    caches = {f"{classes[n][0]}:{n}" for n in classes
              if "attend" in methods(n) and methods(n) & {"bits_per_element", "bytes_read"}}
    assert caches == {"runtime/kvcache.py:FP16Cache", "runtime/kvtiered.py:TieredKVCache",
                      "runtime/latent.py:LatentKVCache", "runtime/rvq.py:RVQTieredCache",
                      "runtime/mla.py:MLACache", "runtime/mla_nuq.py:MLANUQCache",
                      "runtime/kvcache.py:LayerSplitCache"}, sorted(caches)
