"""Runtime half of the tcq weight codec (moec/codecs/tcq.py): the computed code, the states read back from the
stored stream, the fp32 reference dequantization, what runtime/experts.QuantMatrix holds, and the random
stand-in of `moec pack --random`.

A row of I weights is one path through a bitshift trellis of L = STATE_BITS-bit states: weight t appends its k-bit
symbol b_t at the top of the state, s_t = (s_{t-1} >> k) | (b_t << (L − k)), so s_t is the L-bit window of the
row's bit stream that ends with b_t. Its value is row_scale · code(s_t) with code() computed from the state, no
table (QTIP's "1MAD": x = 34038481·s + 76625530 mod 2^32, the sum of x's four bytes, a near-Gaussian integer in
[0, 1020], centred at 510 and divided by 128: exact in fp32 and fp16 arithmetic, standard deviation 1.155).

Stored (formats/codecs.py WeightCodec.TCQ): codes uint8 [E, O, 4 · (1 + ceil(k·I / 32))], each row a stream of
little-endian 32-bit words: word 0 (the lead word) holds the first state's other L − k bits in its top bits and the
row's fp16 scale in its low 16 bits, b_t sits at stream bit 32 + k·t, so s_t = stream bits [32 + k·(t + 1) − L,
32 + k·(t + 1)). A kernel reading 32/k weights of one word therefore needs that word and the one before it, nothing
else; no state reaches below bit 32 − (L − k) ≥ 22 of the lead word, so the scale's bits never enter a state.
Packs written before the scale moved into the lead word (stop 50) store it as a part, row_scale fp16 [E, O], with
the lead word's low bits zero: row_scale() reads both.
"""

from __future__ import annotations

import torch

from ..formats.codecs import TCQ_LEAD_BITS, TCQ_STATE_BITS

MAD_A, MAD_B = 34038481, 76625530
CODE_CENTRE, CODE_DIV = 510, 128  # code = (byte sum − 510) / 128: a power of two, so every product is exact
CODE_STD = (4 * (256**2 - 1) / 12) ** 0.5 / CODE_DIV  # the sum of four uniform bytes, over 128


def centred_sum(states: torch.Tensor) -> torch.Tensor:
    """(byte sum of 34038481·s + 76625530 mod 2^32) − 510, fp32 (exact integers), for int64 states (1MAD)."""
    x = (MAD_A * states + MAD_B) & 0xFFFFFFFF
    total = (x & 0xFF) + ((x >> 8) & 0xFF) + ((x >> 16) & 0xFF) + (x >> 24)
    return (total - CODE_CENTRE).float()


def code_of(states: torch.Tensor) -> torch.Tensor:
    """code(s) fp32 for int64 states of any shape: the centred byte sum over 128."""
    return centred_sum(states) / CODE_DIV


def code_table(L: int = TCQ_STATE_BITS) -> torch.Tensor:
    """code(s) for every L-bit state [2^L] fp32."""
    return code_of(torch.arange(1 << L, dtype=torch.int64))


def row_words(n_in: int, bits: int) -> int:
    """32-bit words per stored row: the lead word and the symbols."""
    return 1 + -(-bits * n_in // 32)


def pack_states(states: torch.Tensor, bits: int, scale: torch.Tensor | None = None,
                L: int = TCQ_STATE_BITS) -> torch.Tensor:
    """states [..., I] int64 (each the previous one shifted down by `bits` with the new symbol on top) and the row
    scales [...] (fp16 values; None: zero) -> the stored codes uint8 [..., 4 · row_words]."""
    *lead, I = states.shape
    k = bits
    words = torch.zeros(*lead, row_words(I, k), dtype=torch.int64, device=states.device)
    words[..., 0] = (states[..., 0] & ((1 << (L - k)) - 1)) << (TCQ_LEAD_BITS - (L - k))
    sym = states >> (L - k)  # b_t, k bits
    pos = TCQ_LEAD_BITS + k * torch.arange(I, device=states.device)  # stream bit of b_t
    w, off = pos // 32, pos % 32
    lo = (sym << off) & 0xFFFFFFFF
    words.scatter_add_(-1, w.expand_as(sym), lo)  # disjoint bit fields: the sum is the or
    spill = off + k > 32  # a symbol straddling two words (k = 3)
    if spill.any():
        hi = torch.where(spill, sym >> (32 - off), torch.zeros_like(sym))
        words.scatter_add_(-1, (w + 1).clamp_max(words.shape[-1] - 1).expand_as(sym), hi)
    b = ((words[..., None] >> (8 * torch.arange(4, device=states.device))) & 0xFF).flatten(-2).to(torch.uint8)
    return b if scale is None else with_lead_scale(b, scale)


def unpack_states(codes: torch.Tensor, bits: int, n_in: int, L: int = TCQ_STATE_BITS) -> torch.Tensor:
    """The stored codes uint8 [..., 4 · row_words] -> states int64 [..., n_in]."""
    b = codes.long().view(*codes.shape[:-1], -1, 4)
    words = (b << (8 * torch.arange(4, device=codes.device))).sum(-1)  # [..., words]
    words = torch.cat([words, torch.zeros_like(words[..., :1])], -1)  # a window may end in the last word
    end = TCQ_LEAD_BITS + bits * (torch.arange(n_in, device=codes.device) + 1)  # one past s_t's top bit
    start = end - L
    w, off = start // 32, start % 32
    pair = words[..., w] | (words[..., w + 1] << 32)  # the 64 bits holding the window
    return (pair >> off) & ((1 << L) - 1)


def lead_scale(codes: torch.Tensor) -> torch.Tensor:
    """The row scales fp16 [...] held in the low 16 bits of each row's lead word (codes uint8 [..., 4 · words])."""
    return codes[..., :2].contiguous().view(torch.float16)[..., 0]


def with_lead_scale(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The codes with each lead word's scale bits replaced by `scale` [...] (fp16 values); the stream as it was."""
    out = codes.clone()
    out[..., :2] = scale.to(torch.float16).contiguous()[..., None].view(torch.uint8)
    return out


def row_scale(stored: dict) -> torch.Tensor:
    """The fp16 row scales [E, O] of stored parts: the lead words', or a stop-50 pack's row_scale part."""
    return stored["row_scale"] if "row_scale" in stored else lead_scale(stored["codes"])


def dequantize_tcq(bits: int, shape: tuple[int, int, int], stored: dict) -> torch.Tensor:
    """W_hat [E, O, I] fp32 = row scale · code(s_t) (the reference)."""
    E, O, I = shape
    states = unpack_states(stored["codes"], bits, I)
    return code_of(states) * row_scale(stored).float()[..., None]


def hold_tcq(bits: int, stored: dict) -> dict:
    """Codes and the fp32 row scale over 128 (exact), so a kernel computes (byte sum − 510) · scale in one
    multiply: bit for bit dequantize_tcq's value."""
    return {"codes": stored["codes"].contiguous(), "scale": (row_scale(stored).float() / CODE_DIV).contiguous()}


def held_dequantize_tcq(bits: int, shape: tuple[int, int, int], held: dict) -> torch.Tensor:
    """centred_sum(state) · (row scale / 128): what the kernels compute, equal to dequantize_tcq bit for bit."""
    return centred_sum(unpack_states(held["codes"], bits, shape[2])) * held["scale"][..., None]


def held_group_tcq(shape, held: dict) -> int:
    return shape[2]


def random_tcq(bits, shape, group_size, device, gen=None):
    """Random streams (any bits are a valid path), row scale 0.02 / CODE_STD (in the lead words)."""
    E, O, I = shape
    codes = torch.randint(0, 256, (E, O, 4 * row_words(I, bits)), dtype=torch.uint8, device=device, generator=gen)
    codes[..., :4] = 0  # the lead word's unused bits stay zero, as pack_states writes them
    codes[..., 3] = torch.randint(0, 256, (E, O), dtype=torch.uint8, device=device, generator=gen)
    codes = with_lead_scale(codes, torch.full((E, O), 0.02 / CODE_STD, device=device))
    if (bits * I) % 32:  # padding bits past the last symbol stay zero
        used = (bits * I) % 32
        tail = codes[..., -4:].clone().view(torch.int32).long() & ((1 << used) - 1)
        codes[..., -4:] = ((tail[..., None] >> (8 * torch.arange(4, device=device))) & 0xFF).flatten(-2).to(
            torch.uint8)
    return {"codes": codes}
