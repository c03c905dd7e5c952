"""The CUDA backend's paged attention kernels in Triton (engine/attention/cuda.py launches them and
says how they compute): decode ("sum" and "dot", split-KV with its merge) and a prompt chunk's
prefill, over blocks (n_blocks, KV heads, B, D) read in place.

Grouped-query attention (Llama: KV heads fewer than query heads, GROUP query heads each): a program
takes one KV head and every query head that reads it, its tile a lane per (row, query head), so a
block's keys and values are read once for the GROUP query heads, and the scores of a step are one
(lanes, D) x (D, keys) product (tl.dot in "dot" and prefill). Query head h reads KV head h // GROUP.
Lanes are rows x GP, GP the group rounded up to a power of two (lanes past GROUP masked); GROUP = 1
is one lane per row, as before grouping.
"""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # policy.attention_path chooses the cuda backend only where Triton is installed
    triton = None


if triton is not None:
    @triton.jit
    def _softmax_tile(s, v, m, den, acc):
        """One tile of keys into the running softmax: scores s (R, B), -inf where masked; values v
        (R or 1, B, D) float32; running max m (R,), sum den (R,), weighted values acc (R, D)."""
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)  # the old sums' rescale (0 at the first tile: m = -inf)
        p = tl.exp(s - m_new[:, None])
        return m_new, den * alpha + tl.sum(p, axis=1), acc * alpha[:, None] + tl.sum(p[:, :, None] * v, axis=1)

    @triton.jit
    def _own_blocks(q, kc_ptr, vc_ptr, ks_ptr, vs_ptr, otab_ptr, olen, rows, rmask, d, dmask,
                    omax, scale, kh, s_kb, s_kh, s_kt, s_sb, s_sh, m, den, acc, B: tl.constexpr,
                    KEYS: tl.constexpr, QUANTIZED: tl.constexpr):
        """Each lane's row's own blocks (beams: what they wrote since the prompt), KV head kh, into its
        running softmax, an (R, KEYS, D) tile a step (KEYS tokens of one block, KEYS dividing B),
        float32 on CUDA cores: q (R, D) float32, one lane per (row, query head of kh), rows (R,) each
        lane's row, olen the rows' own tokens -> (m, den, acc)."""
        t = tl.arange(0, KEYS)
        for j in range(0, tl.cdiv(olen, KEYS)):
            block = tl.load(otab_ptr + rows * omax + j * KEYS // B, mask=rmask, other=0).to(tl.int64)  # (R,)
            row = j * KEYS % B + t  # the tokens' rows in their block
            tmask = j * KEYS + t < olen
            at = block[:, None, None] * s_kb + kh * s_kh + row[None, :, None] * s_kt + d[None, None, :]
            kvmask = rmask[:, None, None] & tmask[None, :, None] & dmask[None, None, :]
            k = tl.load(kc_ptr + at, mask=kvmask, other=0.0).to(tl.float32)  # (R, KEYS, D)
            v = tl.load(vc_ptr + at, mask=kvmask, other=0.0).to(tl.float32)
            if QUANTIZED:
                sat = block[:, None] * s_sb + kh * s_sh + row[None, :]
                smask = rmask[:, None] & tmask[None, :]
                k = k * tl.load(ks_ptr + sat, mask=smask, other=0.0)[:, :, None]
                v = v * tl.load(vs_ptr + sat, mask=smask, other=0.0)[:, :, None]
            s = tl.sum(q[:, None, :] * k, axis=2) * scale  # (R, KEYS)
            m, den, acc = _softmax_tile(tl.where(tmask[None, :], s, float("-inf")), v, m, den, acc)
        return m, den, acc

    @triton.jit
    def _span(slen, s, S, SPAN: tl.constexpr):
        """Split s's part of a group's slen shared tokens: (first token, end, the group's spans, s is its
        last). A group's spans are SPAN tokens each (at least one: a group without shared tokens has
        one, empty), at most S (the launch's splits: the last takes the rest); a split past them
        reads nothing."""
        spans = tl.minimum(tl.maximum(tl.cdiv(slen, SPAN), 1), S)
        first = s * SPAN
        end = tl.where(s == spans - 1, slen, tl.minimum(slen, first + SPAN))
        return first, tl.where(s < spans, end, first), spans, s == spans - 1

    @triton.jit
    def _finish_rows(m, den, acc, rows, rmask, d, dmask, heads, s, spans, out_ptr, s_on, s_oh,
                     pacc_ptr, pml_ptr, pspan_ptr, H, S, D):
        """A split's running softmax (m, den, acc) of its lanes (row rows[i], query head heads[i]): a
        group of one span stores its output; of more, each split its partial (acc, and m, den), which
        _merge_splits_kernel combines, and split 0 the lanes' span count."""
        whole = tl.where(spans == 1, rmask, False)  # (tl.where: the interpreter's rmask & scalar is not a mask)
        out = acc / tl.maximum(den, 1.0)[:, None]  # den >= 1 on every row (its top key adds exp(0)); 0 on padding
        tl.store(out_ptr + rows[:, None] * s_on + heads[:, None] * s_oh + d[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=whole[:, None] & dmask[None, :])
        if S > 1:  # (the launch's splits: with one, no partials, no count)
            part = tl.where(spans == 1, False, rmask)
            at = (rows.to(tl.int64) * H + heads) * S + s  # (R,) partial (row, head, split)
            tl.store(pacc_ptr + at[:, None] * D + d[None, :], acc, mask=part[:, None] & dmask[None, :])
            tl.store(pml_ptr + at * 2, m, mask=part)
            tl.store(pml_ptr + at * 2 + 1, den, mask=part)
            tl.store(pspan_ptr + rows.to(tl.int64) * H + heads, spans, mask=tl.where(s == 0, rmask, False))

    @triton.jit(do_not_specialize=["S"])
    def _merge_splits_kernel(pacc_ptr, pml_ptr, pspan_ptr, out_ptr, H, S, D, s_on, s_oh, BLOCK_D: tl.constexpr):
        """Program (row n, head h): a row of more than one span, its splits' partials merged in
        order 0, 1, ... (the online softmax's rescale, a span at a time) and stored; rows of one
        span stored their output already."""
        n = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        spans = tl.load(pspan_ptr + n * H + h)
        d = tl.arange(0, BLOCK_D)
        dmask = d < D
        m = tl.full([1], float("-inf"), tl.float32)
        den = tl.zeros([1], tl.float32)
        acc = tl.zeros([BLOCK_D], tl.float32)
        for s in range(0, tl.where(spans > 1, spans, 0)):
            at = (n * H + h) * S + s
            ms = tl.load(pml_ptr + at * 2 + tl.arange(0, 1))  # every span has a key: finite
            ds = tl.load(pml_ptr + at * 2 + 1 + tl.arange(0, 1))
            m_new = tl.maximum(m, ms)
            alpha = tl.exp(m - m_new)  # 0 at the first span (m = -inf)
            beta = tl.exp(ms - m_new)
            den = den * alpha + ds * beta
            acc = acc * alpha + tl.load(pacc_ptr + at * D + d, mask=dmask, other=0.0) * beta
            m = m_new
        out = acc / tl.maximum(den, 1.0)
        tl.store(out_ptr + n * s_on + h * s_oh + d, out.to(out_ptr.dtype.element_ty),
                 mask=tl.where(spans > 1, dmask, False))

    @triton.jit(do_not_specialize=["omax", "lo", "hi", "S"])
    def _paged_decode_kernel(q_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, out_ptr,
                             row0_ptr, stab_ptr, soff_ptr, slen_ptr, otab_ptr, olen_ptr,
                             pacc_ptr, pml_ptr, pspan_ptr,
                             omax, lo, hi, S, scale, H, D,
                             s_qn, s_qh, s_kb, s_kh, s_kt, s_sb, s_sh, s_on, s_oh,
                             B: tl.constexpr, KEYS: tl.constexpr, SPAN: tl.constexpr, BLOCK_R: tl.constexpr,
                             BLOCK_D: tl.constexpr, QUANTIZED: tl.constexpr, GROUP: tl.constexpr,
                             GP: tl.constexpr):
        """Program (group g, KV head kh, split s), for groups of lo to hi rows (others: another launch's):
        the group's shared tokens of span s (_span), and if s is the group's last span, each row's
        own blocks; keys and values KEYS tokens a step (decode_tiles). Its tile of queries has a lane
        per (row, query head of kh): BLOCK_R rows x GP (GROUP query heads a KV head, rounded up to a
        power of two; lanes past GROUP masked), so a KV head's keys and values are read once for all
        of its query heads (grouped-query attention; GROUP = GP = 1: a lane per row)."""
        g = tl.program_id(0)
        kh = tl.program_id(1)
        split = tl.program_id(2)
        first = tl.load(row0_ptr + g)
        end = tl.load(row0_ptr + g + 1)
        t0, t1, spans, last = _span(tl.load(slen_ptr + g), split, S, SPAN)
        take = (end - first >= lo) & (end - first <= hi) & (split < spans)  # (not an early return: ptxas spilled)
        end = tl.where(take, end, first)  # another launch's group, or a split past its spans: no rows, no keys
        lane = tl.arange(0, BLOCK_R * GP)
        rows = first + lane // GP
        heads = kh * GROUP + lane % GP
        rmask = (rows < end) & (lane % GP < GROUP)
        d = tl.arange(0, BLOCK_D)
        dmask = d < D
        t = tl.arange(0, KEYS)
        q = tl.load(q_ptr + rows[:, None] * s_qn + heads[:, None] * s_qh + d[None, :],
                    mask=rmask[:, None] & dmask[None, :], other=0.0).to(tl.float32)  # (R, D): a lane a row
        m = tl.full([BLOCK_R * GP], float("-inf"), tl.float32)  # running max of each lane's scores
        den = tl.zeros([BLOCK_R * GP], tl.float32)  # running sum of exp(score - m)
        acc = tl.zeros([BLOCK_R * GP, BLOCK_D], tl.float32)  # running sum of exp(score - m) * value

        # the span's shared tokens: one (KEYS, D) tile of keys and values for all of the group's rows
        t1 = tl.where(take, t1, t0)
        soff = tl.load(soff_ptr + g)
        for j in range(t0 // KEYS, tl.cdiv(t1, KEYS)):
            block = tl.load(stab_ptr + soff + j * KEYS // B).to(tl.int64)
            row = j * KEYS % B + t  # the tokens' rows in their block
            tmask = j * KEYS + t < t1
            at = block * s_kb + kh * s_kh + row[:, None] * s_kt + d[None, :]
            kvmask = tmask[:, None] & dmask[None, :]
            k = tl.load(kc_ptr + at, mask=kvmask, other=0.0).to(tl.float32)  # (KEYS, D)
            v = tl.load(vc_ptr + at, mask=kvmask, other=0.0).to(tl.float32)
            if QUANTIZED:
                sat = block * s_sb + kh * s_sh + row
                k = k * tl.load(ks_ptr + sat, mask=tmask, other=0.0)[:, None]
                v = v * tl.load(vs_ptr + sat, mask=tmask, other=0.0)[:, None]
            s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # (R, KEYS)
            m, den, acc = _softmax_tile(tl.where(tmask[None, :], s, float("-inf")), v[None, :, :], m, den, acc)

        # each row's own blocks (beams: what they wrote since the prompt), in the group's last span: an
        # (R, KEYS, D) tile
        olen = tl.where(take & last, tl.load(olen_ptr + g), 0)
        m, den, acc = _own_blocks(q, kc_ptr, vc_ptr, ks_ptr, vs_ptr, otab_ptr, olen, rows, rmask, d, dmask,
                                  omax, scale, kh, s_kb, s_kh, s_kt, s_sb, s_sh, m, den, acc, B, KEYS, QUANTIZED)
        _finish_rows(m, den, acc, rows, rmask, d, dmask, heads, split, spans, out_ptr, s_on, s_oh,
                     pacc_ptr, pml_ptr, pspan_ptr, H, S, D)


if triton is not None:
    @triton.jit(do_not_specialize=["omax", "lo", "hi", "S"])
    def _paged_decode_dot_kernel(q_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, out_ptr,
                                 row0_ptr, stab_ptr, soff_ptr, slen_ptr, otab_ptr, olen_ptr,
                                 pacc_ptr, pml_ptr, pspan_ptr,
                                 omax, lo, hi, S, scale, H, D,
                                 s_qn, s_qh, s_kb, s_kh, s_kt, s_sb, s_sh, s_on, s_oh,
                                 B: tl.constexpr, KEYS: tl.constexpr, SPAN: tl.constexpr, BLOCK_R: tl.constexpr,
                                 DOT_R: tl.constexpr, BLOCK_D: tl.constexpr, QUANTIZED: tl.constexpr,
                                 IEEE: tl.constexpr, GROUP: tl.constexpr, GP: tl.constexpr):
        """_paged_decode_kernel's "dot" variant: the group's shared blocks by tl.dot (tensor cores) on a
        tile of DOT_R = max(16, BLOCK_R x GP) lanes (a lane per (row, query head of the program's KV
        head), as the "sum" kernel's), with the prefill kernel's conventions (float32: IEEE;
        16-bit: q and keys in their dtype, the probabilities rounded to the values' dtype, float32
        sums; quantized blocks dequantized to the compute dtype); the running softmax then moves to
        the BLOCK_R x GP lanes (an exact selection) and each row's own blocks are read as the "sum"
        kernel reads them. Groups of lo to hi rows (others: another launch's); split s as the "sum" kernel's."""
        g = tl.program_id(0)
        kh = tl.program_id(1)
        split = tl.program_id(2)
        first = tl.load(row0_ptr + g)
        end = tl.load(row0_ptr + g + 1)
        t0, t1, spans, last = _span(tl.load(slen_ptr + g), split, S, SPAN)
        take = (end - first >= lo) & (end - first <= hi) & (split < spans)  # (not an early return: ptxas spilled)
        end = tl.where(take, end, first)  # another launch's group, or a split past its spans: no rows, no keys
        d = tl.arange(0, BLOCK_D)
        dmask = d < D
        t = tl.arange(0, B)
        r16 = tl.arange(0, DOT_R)  # lanes: (row first + r16 // GP, query head kh * GROUP + r16 % GP)
        at16 = (first + r16 // GP)[:, None] * s_qn + (kh * GROUP + r16 % GP)[:, None] * s_qh + d[None, :]
        q16 = tl.load(q_ptr + at16, mask=((first + r16 // GP < end) & (r16 % GP < GROUP))[:, None] & dmask[None, :],
                      other=0.0)  # (DOT_R, D), q's dtype
        m16 = tl.full([DOT_R], float("-inf"), tl.float32)
        den16 = tl.zeros([DOT_R], tl.float32)
        acc16 = tl.zeros([DOT_R, BLOCK_D], tl.float32)

        # the span's shared blocks: scores (DOT_R, B) = q . k^T and values p . v, both by tl.dot
        t1 = tl.where(take, t1, t0)
        soff = tl.load(soff_ptr + g)
        for j in range(t0 // B, tl.cdiv(t1, B)):
            block = tl.load(stab_ptr + soff + j).to(tl.int64)
            tmask = j * B + t < t1
            at = block * s_kb + kh * s_kh + t[:, None] * s_kt + d[None, :]
            kvmask = tmask[:, None] & dmask[None, :]
            k = tl.load(kc_ptr + at, mask=kvmask, other=0.0)  # (B, D)
            v = tl.load(vc_ptr + at, mask=kvmask, other=0.0)
            if QUANTIZED:  # dequantized to the compute dtype, as the prefill kernel reads them
                sat = block * s_sb + kh * s_sh + t
                k = k.to(tl.float32) * tl.load(ks_ptr + sat, mask=tmask, other=0.0)[:, None]
                v = v.to(tl.float32) * tl.load(vs_ptr + sat, mask=tmask, other=0.0)[:, None]
            k = k.to(q16.dtype)
            v = v.to(q16.dtype)
            if IEEE:
                s = tl.dot(q16, tl.trans(k), input_precision="ieee") * scale  # (DOT_R, B) float32
            else:
                s = tl.dot(q16, tl.trans(k)) * scale
            s = tl.where(tmask[None, :], s, float("-inf"))
            m_new = tl.maximum(m16, tl.max(s, axis=1))
            alpha = tl.exp(m16 - m_new)  # 0 at the first tile (m = -inf); every tile has a key
            p = tl.exp(s - m_new[:, None])
            den16 = den16 * alpha + tl.sum(p, axis=1)
            if IEEE:
                acc16 = acc16 * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
            else:  # the probabilities rounded to the values' dtype (HF's rule), summed in float32
                acc16 = acc16 * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m16 = m_new

        # the running softmax from the DOT_R tile to the BLOCK_R x GP lanes: each lane's own values, exactly
        if DOT_R == BLOCK_R * GP:
            m, den, acc = m16, den16, acc16
        else:
            pick = tl.arange(0, BLOCK_R * GP)[:, None] == r16[None, :]  # (R, DOT_R)
            m = tl.max(tl.where(pick, m16[None, :], float("-inf")), axis=1)
            den = tl.sum(tl.where(pick, den16[None, :], 0.0), axis=1)
            acc = tl.sum(tl.where(pick[:, :, None], acc16[None, :, :], 0.0), axis=1)

        # each row's own blocks: as _paged_decode_kernel reads them (float32 on CUDA cores)
        lane = tl.arange(0, BLOCK_R * GP)
        rows = first + lane // GP
        heads = kh * GROUP + lane % GP
        rmask = (rows < end) & (lane % GP < GROUP)
        q = tl.load(q_ptr + rows[:, None] * s_qn + heads[:, None] * s_qh + d[None, :],
                    mask=rmask[:, None] & dmask[None, :], other=0.0).to(tl.float32)  # (R, D)
        olen = tl.where(take & last, tl.load(olen_ptr + g), 0)
        m, den, acc = _own_blocks(q, kc_ptr, vc_ptr, ks_ptr, vs_ptr, otab_ptr, olen, rows, rmask, d, dmask,
                                  omax, scale, kh, s_kb, s_kh, s_kt, s_sb, s_sh, m, den, acc, B, KEYS, QUANTIZED)
        _finish_rows(m, den, acc, rows, rmask, d, dmask, heads, split, spans, out_ptr, s_on, s_oh,
                     pacc_ptr, pml_ptr, pspan_ptr, H, S, D)


if triton is not None:
    @triton.jit(do_not_specialize=["start", "T"])  # a chunk's start and length vary: one binary for all
    def _paged_prefill_kernel(q_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, out_ptr, table_ptr,
                              start, T, scale, D,
                              s_qt, s_qh, s_kb, s_kh, s_kt, s_sb, s_sh, s_ot, s_oh,
                              B: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
                              QUANTIZED: tl.constexpr, IEEE: tl.constexpr, GROUP: tl.constexpr, GP: tl.constexpr):
        """One (tile of BLOCK_M queries, KV head kh): causal attention over the sequence's blocks in
        place, a lane per (query, query head of kh): BLOCK_M x GP lanes (GROUP query heads a KV head,
        rounded up to a power of two; lanes past GROUP masked), so each block of keys and values is
        read once for the KV head's query heads (grouped-query attention; GROUP = GP = 1: one)."""
        tile = tl.program_id(0)
        kh = tl.program_id(1)
        lane = tl.arange(0, BLOCK_M * GP)
        qi = tile * BLOCK_M + lane // GP
        heads = kh * GROUP + lane % GP
        qmask = (qi < T) & (lane % GP < GROUP)
        qpos = start + qi
        d = tl.arange(0, BLOCK_D)
        dmask = d < D
        t = tl.arange(0, B)
        q = tl.load(q_ptr + qi[:, None] * s_qt + heads[:, None] * s_qh + d[None, :],
                    mask=qmask[:, None] & dmask[None, :], other=0.0)  # (lanes, D) in the compute dtype
        m = tl.full([BLOCK_M * GP], float("-inf"), tl.float32)
        den = tl.zeros([BLOCK_M * GP], tl.float32)
        acc = tl.zeros([BLOCK_M * GP, BLOCK_D], tl.float32)
        last = start + tl.minimum(tile * BLOCK_M + BLOCK_M, T) - 1  # the tile's last query position
        for j in range(0, last // B + 1):
            block = tl.load(table_ptr + j).to(tl.int64)
            stored = j * B + t <= last  # rows past the tile's last query are unwritten (never read)
            at = block * s_kb + kh * s_kh + t[:, None] * s_kt + d[None, :]
            k = tl.load(kc_ptr + at, mask=stored[:, None] & dmask[None, :], other=0.0)  # (B, D)
            v = tl.load(vc_ptr + at, mask=stored[:, None] & dmask[None, :], other=0.0)
            if QUANTIZED:  # dequantized to the compute dtype, as the reference reads quantized blocks
                sat = block * s_sb + kh * s_sh + t
                k = (k.to(tl.float32) * tl.load(ks_ptr + sat, mask=stored, other=0.0)[:, None]).to(q.dtype)
                v = (v.to(tl.float32) * tl.load(vs_ptr + sat, mask=stored, other=0.0)[:, None]).to(q.dtype)
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # (M, B) float32
            else:
                s = tl.dot(q, tl.trans(k)) * scale
            s = tl.where((j * B + t)[None, :] <= qpos[:, None], s, float("-inf"))  # causal
            m_new = tl.maximum(m, tl.max(s, axis=1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new[:, None])
            den = den * alpha + tl.sum(p, axis=1)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
            else:  # the probabilities rounded to the values' dtype (HF's rule), summed in float32
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m = m_new
        out = acc / tl.maximum(den, 1.0)[:, None]  # den >= 1 on every query (its top key adds exp(0))
        tl.store(out_ptr + qi[:, None] * s_ot + heads[:, None] * s_oh + d[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=qmask[:, None] & dmask[None, :])


