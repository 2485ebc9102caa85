"""Paged causal attention with grouped-query heads, for prefill chunks and decode alike.

Every new token ``t`` (at absolute position ``positions[t]`` of sequence ``token_seq[t]``)
attends to keys ``0 .. positions[t]`` of its sequence, found through the page table. The
keys of the token's own chunk were appended by ``rope_kv`` just before, so one rule covers
a prefill chunk (causal within the chunk, full over the cached prefix) and a decode step.

q comes from the fused projection buffer ``qkv`` (already rotated), and the output
``out[t, h*head_dim + d]`` has the q-head layout the output projection expects. q head
``h`` reads kv head ``h // (num_q_heads // num_kv_heads)`` (transformers' ``repeat_kv``).
"""
import math
from typing import Any

import numpy as np
from numba import cuda, float32, int32, njit, prange

from engines.runtime.model.kernels.fast_exp import exp_f32, softmax_numerators_and_max
from engines.runtime.model.kernels.launch_cost import LaunchCost, nbytes
from engines.runtime.model.kernels.variants import renamed

# Reassociation lets LLVM vectorise the q.k dot products (the hot loop); no flags that
# assume finite values or approximate exp, so NaN/inf still propagate as they should.
_FASTMATH = {"reassoc", "contract", "nsz", "arcp"}

ATTN_MAX_THREADS = 128   # largest blockDim.x: keys scored per chunk
ATTN_MAX_GROUP = 16      # largest number of q heads sharing one kv head
ATTN_MAX_HEAD_DIM = 256
ATTN_MAX_PAIRS = 16      # (q head, dim) outputs per thread: group * head_dim <= 16 * blockDim.x


@cuda.jit(cache=True)
def paged_attention_cuda(qkv, positions, token_seq, page_table, k_cache, v_cache, layer, num_q_heads, scale, out):
    """Grid ``(num_tokens, num_kv_heads, splits)``, block ``(threads,)``; ``head_dim`` a multiple
    of 4, ``splits`` a divisor of the group (``num_q_heads // num_kv_heads``).

    Block (t, kv head, z) serves q heads ``z * sub .. (z + 1) * sub`` of the group (``sub =
    group // splits``), so each key and value is read from memory once per ``sub`` q heads. A
    decode step has too few (token, kv head) pairs to fill the GPU and each block's threads
    work through their keys and outputs one after another, so there ``splits`` is the group
    (one q head a block: eight times less work a thread for a group of eight), and the other
    blocks of the group re-read the same keys from L2.

    Keys are taken ``blockDim.x`` at a time with an online softmax: thread i scores key
    ``c0 + i`` against every q head of the block; one thread per head
    folds the chunk into the running max and sum (rescaling by ``alpha``); then the threads
    update the output accumulators, thread-strided over ``(head, dim)`` pairs so that
    neighbouring threads read neighbouring values of a V row.
    """
    q_sh = cuda.shared.array((ATTN_MAX_GROUP, ATTN_MAX_HEAD_DIM), float32)
    p_sh = cuda.shared.array((ATTN_MAX_GROUP, ATTN_MAX_THREADS), float32)
    page_sh = cuda.shared.array(ATTN_MAX_THREADS, int32)
    slot_sh = cuda.shared.array(ATTN_MAX_THREADS, int32)
    m_sh = cuda.shared.array(ATTN_MAX_GROUP, float32)
    l_sh = cuda.shared.array(ATTN_MAX_GROUP, float32)
    alpha_sh = cuda.shared.array(ATTN_MAX_GROUP, float32)
    acc = cuda.local.array(ATTN_MAX_PAIRS, float32)

    t = cuda.blockIdx.x
    kv_head = cuda.blockIdx.y
    tid = cuda.threadIdx.x
    nthreads = cuda.blockDim.x
    num_kv_heads = k_cache.shape[2]
    page_size = k_cache.shape[3]
    head_dim = k_cache.shape[4]
    group = num_q_heads // num_kv_heads // cuda.gridDim.z  # this block's q heads
    pairs = group * head_dim
    q_base = (kv_head * cuda.gridDim.z + cuda.blockIdx.z) * pairs
    seq = token_seq[t]
    num_keys = positions[t] + 1

    for p in range(tid, pairs, nthreads):
        q_sh[p // head_dim, p % head_dim] = qkv[t, q_base + p] * scale
    if tid < group:
        m_sh[tid] = float32(-math.inf)
        l_sh[tid] = float32(0.0)
    for a in range(ATTN_MAX_PAIRS):
        acc[a] = float32(0.0)
    cuda.syncthreads()

    # The inner loops below are unrolled by four: memory latency, not bandwidth, bounds
    # this kernel, so each thread keeps four loads in flight.
    for c0 in range(0, num_keys, nthreads):
        n = min(nthreads, num_keys - c0)
        if tid < n:
            j = c0 + tid
            page = page_table[seq, j // page_size]
            slot = j % page_size
            page_sh[tid] = page
            slot_sh[tid] = slot
            for g in range(group):
                s = float32(0.0)
                for d in range(0, head_dim, 4):
                    k0 = float32(k_cache[layer, page, kv_head, slot, d])
                    k1 = float32(k_cache[layer, page, kv_head, slot, d + 1])
                    k2 = float32(k_cache[layer, page, kv_head, slot, d + 2])
                    k3 = float32(k_cache[layer, page, kv_head, slot, d + 3])
                    s += q_sh[g, d] * k0 + q_sh[g, d + 1] * k1 + q_sh[g, d + 2] * k2 + q_sh[g, d + 3] * k3
                p_sh[g, tid] = s
        cuda.syncthreads()
        if tid < group:
            m_old = m_sh[tid]
            m_new = m_old
            for i in range(n):
                m_new = max(m_new, p_sh[tid, i])
            alpha = math.exp(m_old - m_new)
            total = l_sh[tid] * alpha
            for i in range(n):
                e = math.exp(p_sh[tid, i] - m_new)
                p_sh[tid, i] = e
                total += e
            m_sh[tid] = m_new
            l_sh[tid] = total
            alpha_sh[tid] = alpha
        cuda.syncthreads()
        a = 0
        last = n - 1
        for p in range(tid, pairs, nthreads):
            g = p // head_dim
            d = p % head_dim
            v_acc = acc[a] * alpha_sh[g]
            for i in range(0, n, 4):
                # Keys past the chunk re-read its last key with a zero weight.
                i1 = min(i + 1, last)
                i2 = min(i + 2, last)
                i3 = min(i + 3, last)
                v0 = float32(v_cache[layer, page_sh[i], kv_head, slot_sh[i], d])
                v1 = float32(v_cache[layer, page_sh[i1], kv_head, slot_sh[i1], d])
                v2 = float32(v_cache[layer, page_sh[i2], kv_head, slot_sh[i2], d])
                v3 = float32(v_cache[layer, page_sh[i3], kv_head, slot_sh[i3], d])
                v_acc += (p_sh[g, i] * v0 + p_sh[g, i1] * v1 * float32(i + 1 <= last)
                          + p_sh[g, i2] * v2 * float32(i + 2 <= last) + p_sh[g, i3] * v3 * float32(i + 3 <= last))
            acc[a] = v_acc
            a += 1
        # p_sh, page_sh and slot_sh are overwritten by the next chunk.
        cuda.syncthreads()

    a = 0
    for p in range(tid, pairs, nthreads):
        out[t, q_base + p] = acc[a] / l_sh[p // head_dim]
        a += 1


@njit(nogil=True, cache=True, fastmath=False)
def head_splits(num_tokens: int, num_kv_heads: int, threads: int) -> int:
    """Into how many slices the CPU kernel cuts each token's kv heads: the fewest (a divisor of
    ``num_kv_heads``) that give each of ``threads`` threads a work item."""
    splits = min(num_kv_heads, -(-threads // max(num_tokens, 1)))
    while num_kv_heads % splits:
        splits += 1
    return splits


#: A token's keys are cut into slices only when each holds at least this many whole pages, so
#: that every slice still reads four pages side by side (below it, heads are cut instead).
MIN_PAGES_PER_KEY_SLICE = 4


@njit(nogil=True, cache=True, fastmath=False)
def cpu_attention_splits(positions, num_q_heads, num_kv_heads, page_size, head_dim, min_work, threads):
    """``(head_splits, key_splits)`` for :func:`paged_attention_cpu` in a step on ``threads``
    threads, or ``(0, 0)``: a step of fewer than ``min_work`` multiply-adds, which runs
    single-threaded (:func:`paged_attention_serial_cpu`). With fewer tokens than threads each
    token is cut: into slices of its keys where every token's context holds
    ``MIN_PAGES_PER_KEY_SLICE`` whole pages a slice, else into slices of its heads
    (:func:`head_splits`). Compiled, so that the CPU decode step decides inside its one call: in
    Python, right after a step has streamed the weights through the caches, the same few lines
    took a share of a batch-1 step (docs/perf-log/cpu-anchors.md#2026-11-25-python-around-a-step)."""
    work = (positions.sum() + positions.shape[0]) * num_q_heads * head_dim * 2
    if work < min_work:
        return 0, 0
    num_tokens = positions.shape[0]
    slices = -(-threads // max(num_tokens, 1))
    if slices > 1 and (positions.min() + 1) // page_size >= MIN_PAGES_PER_KEY_SLICE * slices:
        return 1, slices
    return head_splits(num_tokens, num_kv_heads, threads), 1


@njit(inline="always")
def _key_slice(num_keys, page_size, splits, part):
    """Pages ``[first, end)`` of slice ``part`` of ``splits`` of a context of ``num_keys`` keys
    (empty when there are fewer pages than slices)."""
    num_pages = (num_keys + page_size - 1) // page_size
    return part * num_pages // splits, (part + 1) * num_pages // splits


@njit(inline="always")
def _score_page(q, page, first_head, count, first, group, per_item, scores):
    """``scores[i, first + s]`` = q head ``i`` . key ``s`` of one page (``[kv head, slot, dim]``),
    for kv heads ``first_head ..`` (``per_item`` of them) and the page's first ``count`` slots."""
    head_dim = q.shape[1]
    for h in range(per_item):
        keys = page[first_head + h]
        for s in range(count):
            key = keys[s]
            for g in range(group):
                qi = q[h * group + g]
                dot = float32(0.0)
                for d in range(head_dim):
                    dot += qi[d] * key[d]
                scores[h * group + g, first + s] = dot


@njit(inline="always")
def _score_four_pages(q, p0, p1, p2, p3, first_head, first, stride, group, per_item, scores):
    """:func:`_score_page` for four whole pages at once, whose first keys are at positions
    ``first + f * stride``: each slot's four keys are read side by side, four memory streams
    instead of one."""
    head_dim = q.shape[1]
    for h in range(per_item):
        k0 = p0[first_head + h]
        k1 = p1[first_head + h]
        k2 = p2[first_head + h]
        k3 = p3[first_head + h]
        for s in range(k0.shape[0]):
            for g in range(group):
                i = h * group + g
                qi = q[i]
                d0 = float32(0.0)
                d1 = float32(0.0)
                d2 = float32(0.0)
                d3 = float32(0.0)
                for d in range(head_dim):
                    d0 += qi[d] * k0[s, d]
                    d1 += qi[d] * k1[s, d]
                    d2 += qi[d] * k2[s, d]
                    d3 += qi[d] * k3[s, d]
                scores[i, first + s] = d0
                scores[i, first + stride + s] = d1
                scores[i, first + 2 * stride + s] = d2
                scores[i, first + 3 * stride + s] = d3


@njit(inline="always")
def _weigh_page(page, first_head, count, first, group, per_item, scores, acc):
    """``acc[i] += scores[i, first + s] * value s`` over one page's first ``count`` slots."""
    head_dim = acc.shape[1]
    for h in range(per_item):
        values = page[first_head + h]
        for s in range(count):
            value = values[s]
            for g in range(group):
                w = scores[h * group + g, first + s]
                a = acc[h * group + g]
                for d in range(head_dim):
                    a[d] += w * value[d]


@njit(inline="always")
def _weigh_four_pages(p0, p1, p2, p3, first_head, first, stride, group, per_item, scores, acc, weighed):
    """:func:`_weigh_page` for four whole pages at once, their values read side by side; the first
    ``weighed`` of them (already in ``acc``) read but given no weight."""
    head_dim = acc.shape[1]
    m0 = float32(weighed < 1)
    m1 = float32(weighed < 2)
    m2 = float32(weighed < 3)
    for h in range(per_item):
        v0 = p0[first_head + h]
        v1 = p1[first_head + h]
        v2 = p2[first_head + h]
        v3 = p3[first_head + h]
        for s in range(v0.shape[0]):
            for g in range(group):
                i = h * group + g
                w0 = scores[i, first + s] * m0
                w1 = scores[i, first + stride + s] * m1
                w2 = scores[i, first + 2 * stride + s] * m2
                w3 = scores[i, first + 3 * stride + s]
                a = acc[i]
                for d in range(head_dim):
                    a[d] += w0 * v0[s, d] + w1 * v1[s, d] + w2 * v2[s, d] + w3 * v3[s, d]


# Compiled once, called by every step that attends (the kernels and both team steps), not inlined
# into each: as numba's inline it was compiled again in each of them, 10-13 s of a cold start a
# time (docs/perf-log/serving-and-tools.md#first-start-compile-time). One signature: callers pass
# ``item`` as an int64.
@njit(nogil=True, cache=True, fastmath=_FASTMATH, error_model="numpy")
def attention_item(item, head_splits, key_splits, qkv, positions, token_seq, page_table, k_cache, v_cache, layer,
                   num_q_heads, scale, out, part_max, part_sum, part_out):
    """Work item ``item`` of :func:`paged_attention_cpu`: one token, one of ``head_splits`` slices of
    its kv heads, one of ``key_splits`` slices of its keys. Its output goes to ``out`` (keys
    whole) or to its slice's ``part_*`` row (keys cut; :func:`merge_key_slices` finishes it)."""
    num_kv_heads = k_cache.shape[2]
    page_size = k_cache.shape[3]
    head_dim = k_cache.shape[4]
    group = num_q_heads // num_kv_heads
    per_item = num_kv_heads // head_splits
    q_heads = per_item * group
    splits = head_splits * key_splits
    t = item // splits
    first_head = (item % splits) // key_splits * per_item
    key_slice = item % key_splits
    part = t * key_splits + key_slice
    q_base = first_head * group  # the item's first q head
    seq = token_seq[t]
    num_keys = positions[t] + 1
    first_page, end_page = _key_slice(num_keys, page_size, key_splits, key_slice)
    count = min(end_page * page_size, num_keys) - first_page * page_size  # the item's keys
    if count <= 0:  # more slices than pages: this one holds none
        for i in range(q_heads):
            part_max[part, q_base + i] = -np.inf
            part_sum[part, q_base + i] = 0.0
            for d in range(head_dim):
                part_out[part, q_base + i, d] = 0.0
    else:
        q = np.empty((q_heads, head_dim), np.float32)
        for i in range(q_heads):
            for d in range(head_dim):
                q[i, d] = qkv[t, (q_base + i) * head_dim + d] * scale
        # Four streams over 4 * quarter whole pages (see _paged_attention). Two or three whole
        # pages past them go in one more group of four, the item's last four whole pages, whose
        # first 4 - rest are scored again (the same values) and left out of the weighted sum: read
        # one by one, they brought a batch's keys in far slower than groups of four do. One page
        # past them is read alone: a group re-reading three for it was slower
        # (docs/perf-log/cpu-anchors.md#2026-11-26-emerald-rapids, code-comments.md#attention-leftover-pages).
        whole = count // page_size
        quarter = whole // 4
        rest = whole % 4 if quarter and whole % 4 >= 2 else 0
        stride = quarter * page_size  # keys between the four pages read side by side
        pages = page_table[seq]
        scores = np.empty((q_heads, count), np.float32)
        for j in range(quarter):
            p = first_page + j
            _score_four_pages(q, k_cache[layer, pages[p]], k_cache[layer, pages[p + quarter]],
                              k_cache[layer, pages[p + 2 * quarter]], k_cache[layer, pages[p + 3 * quarter]],
                              first_head, j * page_size, stride, group, per_item, scores)
        last_four = first_page + whole - 4  # the last group's first page, when there is a rest
        if rest:
            _score_four_pages(q, k_cache[layer, pages[last_four]], k_cache[layer, pages[last_four + 1]],
                              k_cache[layer, pages[last_four + 2]], k_cache[layer, pages[last_four + 3]],
                              first_head, (whole - 4) * page_size, page_size, group, per_item, scores)
        singles = first_page + (whole if rest else 4 * quarter)  # the pages read one by one
        for p in range(singles, end_page):
            first = (p - first_page) * page_size
            _score_page(q, k_cache[layer, pages[p]], first_head, min(page_size, count - first), first, group,
                        per_item, scores)
        tops = np.empty(q_heads, np.float32)
        sums = np.empty(q_heads, np.float32)
        for i in range(q_heads):
            tops[i], sums[i] = softmax_numerators_and_max(scores[i], count)
        acc = np.zeros((q_heads, head_dim), np.float32)
        for j in range(quarter):
            p = first_page + j
            _weigh_four_pages(v_cache[layer, pages[p]], v_cache[layer, pages[p + quarter]],
                              v_cache[layer, pages[p + 2 * quarter]], v_cache[layer, pages[p + 3 * quarter]],
                              first_head, j * page_size, stride, group, per_item, scores, acc, 0)
        if rest:
            _weigh_four_pages(v_cache[layer, pages[last_four]], v_cache[layer, pages[last_four + 1]],
                              v_cache[layer, pages[last_four + 2]], v_cache[layer, pages[last_four + 3]],
                              first_head, (whole - 4) * page_size, page_size, group, per_item, scores, acc, 4 - rest)
        for p in range(singles, end_page):
            first = (p - first_page) * page_size
            _weigh_page(v_cache[layer, pages[p]], first_head, min(page_size, count - first), first, group,
                        per_item, scores, acc)
        if key_splits == 1:
            for i in range(q_heads):
                inverse = float32(1.0) / sums[i]
                for d in range(head_dim):
                    out[t, (q_base + i) * head_dim + d] = acc[i, d] * inverse
        else:
            for i in range(q_heads):
                part_max[part, q_base + i] = tops[i]
                part_sum[part, q_base + i] = sums[i]
                for d in range(head_dim):
                    part_out[part, q_base + i, d] = acc[i, d]


@njit(inline="always")
def merge_key_slices(t, i, key_splits, part_max, part_sum, part_out, out):
    """Token ``t``'s q head ``i`` from its ``key_splits`` slices' maxima, sums and unnormalised
    outputs (a few hundred multiply-adds)."""
    head_dim = part_out.shape[2]
    first_part = t * key_splits
    top = part_max[first_part, i]
    for s in range(1, key_splits):
        top = max(top, part_max[first_part + s, i])
    total = float32(0.0)
    row = out[t, i * head_dim:(i + 1) * head_dim]
    for s in range(key_splits):
        weight = exp_f32(part_max[first_part + s, i] - top)
        total += part_sum[first_part + s, i] * weight
        if s == 0:
            for d in range(head_dim):
                row[d] = part_out[first_part, i, d] * weight
        else:
            for d in range(head_dim):
                row[d] += part_out[first_part + s, i, d] * weight
    inverse = float32(1.0) / total
    for d in range(head_dim):
        row[d] *= inverse


def _paged_attention(qkv, positions, token_seq, page_table, k_cache, v_cache, layer, num_q_heads, scale, out,
                     head_splits, key_splits):
    """Exact two-pass softmax per (token, q head); see :func:`paged_attention_cuda`.

    A work item is one token, one of ``head_splits`` equal slices of its kv heads and one of
    ``key_splits`` slices of its keys (whole pages): all of a token's heads and keys in one item
    unless there are fewer tokens than threads (:func:`cpu_attention_splits`). The item walks its
    pages once for keys and once for values, reading each page's slots of its heads in memory
    order: with every head of a 16-token page that is 32 KB in one run, which the hardware
    prefetcher streams, where one head at a time read 4 KB runs 32 KB apart (decode attention reads
    its KV cache from memory, where that order pays most: docs/perf-log/cpu-anchors.md#2026-11-25-long-weight-streams).
    No key pays for a page-table division, and the 1/sum is folded into the output.

    A token whose keys are cut gets each slice's max, sum and unnormalised output, merged after
    them (flash-decoding's split of a long context). At batch 1 on two threads, halves of the
    keys read whole pages where halves of the heads read half of each, which pays the more the
    longer the context, but loses below four whole pages a slice, whose items lose the four
    streams; there heads are cut (docs/perf-log/cpu-anchors.md#2026-11-26-cycle-counter-pages-in-runs-key-halves).

    Each item reads four of its pages side by side, ``j, j + n/4, j + n/2, j + 3n/4`` of its ``n``
    whole ones (two or three left past them as its last four whole pages again, one left and a
    partial page alone): four memory streams, as the projections read their weights. At batch 1
    one stream a thread kept too few reads in flight to bring the KV in at the memory's rate
    (docs/perf-log/cpu-anchors.md#2026-11-25-compiled-cpu-step). A batch's items of whole tokens
    gain where pages are interleaved between the sequences of a batch or shuffled, and neither gain
    nor lose much over pages contiguous per sequence (docs/perf-log/cpu-anchors.md#2026-11-26-engine-pages).
    """
    num_tokens = qkv.shape[0]
    # Partial results where keys are cut: each slice's max score, sum of numerators and
    # unnormalised output, per q head.
    parts = num_tokens * key_splits if key_splits > 1 else 0
    part_max = np.empty((parts, num_q_heads), np.float32)
    part_sum = np.empty((parts, num_q_heads), np.float32)
    part_out = np.empty((parts, num_q_heads, k_cache.shape[4]), np.float32)
    for item in prange(num_tokens * head_splits * key_splits):
        # prange's index is unsigned in the parallel body: as an int64, one attention_item for all.
        attention_item(np.int64(item), head_splits, key_splits, qkv, positions, token_seq, page_table, k_cache,
                       v_cache, layer, num_q_heads, scale, out, part_max, part_sum, part_out)
    for t in range(num_tokens if key_splits > 1 else 0):  # merge the slices
        for i in range(num_q_heads):
            merge_key_slices(t, i, key_splits, part_max, part_sum, part_out, out)


paged_attention_cpu = njit(nogil=True, cache=True, parallel=True, fastmath=_FASTMATH, error_model="numpy")(
    renamed(_paged_attention, "paged_attention_cpu"))
paged_attention_cpu.__doc__ = """CPU twin of :func:`paged_attention_cuda`: (token, head slice, key slice)
items spread over numba's threads (the last two arguments, from :func:`cpu_attention_splits`). For
decode steps and the short chunks of mixed steps."""
paged_attention_serial_cpu = njit(nogil=True, cache=True, fastmath=_FASTMATH, error_model="numpy")(
    renamed(_paged_attention, "paged_attention_serial_cpu"))
paged_attention_serial_cpu.__doc__ = """Single-threaded :func:`paged_attention_cpu`, for small steps (batch-1
decode), where waking a thread pool costs more than the work (``head_splits`` and ``key_splits``: 1)."""

CUDA_SIGNATURES = {
    paged_attention_cuda: (
        "void(float32[:, ::1], int32[::1], int32[::1], int32[:, ::1], {dt}[:, :, :, :, ::1],"
        " {dt}[:, :, :, :, ::1], int64, int64, float32, float32[:, ::1])"
    ),
}


def launch_cost(args: tuple[Any, ...], kv_positions: int, attended: int) -> LaunchCost:
    """The backend's ``attention(qkv, step, k_cache, v_cache, layer, num_q_heads, scale, out)``: each
    sequence's keys and values read once, each new token against every position up to its own."""
    qkv, _step, k_cache, _v, _layer, num_q_heads, _scale, out = args
    kv_heads, head_dim = k_cache.shape[2], k_cache.shape[4]
    itemsize = np.dtype(k_cache.dtype).itemsize
    kv_bytes = 2 * kv_positions * kv_heads * head_dim * itemsize
    return "attention", kv_bytes + nbytes(qkv) + nbytes(out), 4 * attended * num_q_heads * head_dim
