"""The paged reference attention equals plain dense causal attention."""

import math

import pytest
import torch

from minivllm.model.attention import (AttentionMetadata, paged_attention_reference,
                                      store_kv_reference)


def dense_causal(q, k, v, scale):
    """q: [qlen, Hq, D] at the last qlen positions of k/v: [L, Hkv, D]."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, 1)
    v = v.repeat_interleave(group, 1)
    qlen, L = q.shape[0], k.shape[0]
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * scale
    q_pos = torch.arange(L - qlen, L)[:, None]
    scores = scores.masked_fill(torch.arange(L)[None, :] > q_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.double()).float()


MIXED = [(0, 7), (5, 3), (20, 1), (0, 1), (33, 17)]  # prefill, chunked prefill, decode
DECODE = [(20, 1), (0, 1), (40, 1), (7, 1)]            # decode only: the batched path


@pytest.mark.parametrize("shapes", [MIXED, DECODE], ids=["mixed", "decode"])
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (6, 1)])
def test_paged_reference_matches_dense(block_size, heads, kv_heads, shapes):
    g = torch.Generator().manual_seed(block_size * 10 + heads + kv_heads)
    D = 16
    # (context already cached, new query tokens)
    num_blocks = sum(math.ceil((c + n) / block_size) for c, n in shapes) + 3
    k_cache = torch.zeros(num_blocks, block_size, kv_heads, D)
    v_cache = torch.zeros_like(k_cache)
    perm = torch.randperm(num_blocks, generator=g).tolist()  # scattered, not contiguous
    tables, slots, qs, ks, vs, qsl, lens = [], [], [], [], [], [0], []
    full_k, full_v = [], []
    for cached, new in shapes:
        L = cached + new
        nb = math.ceil(L / block_size)
        table = [perm.pop() for _ in range(nb)]
        tables.append(table)
        k = torch.randn(L, kv_heads, D, generator=g)
        v = torch.randn(L, kv_heads, D, generator=g)
        full_k.append(k)
        full_v.append(v)
        # Earlier steps stored the cached prefix.
        pre_slots = torch.tensor([table[p // block_size] * block_size + p % block_size
                                  for p in range(L)])
        store_kv_reference(k[:cached], v[:cached], k_cache, v_cache, pre_slots[:cached])
        slots.extend(pre_slots[cached:].tolist())
        ks.append(k[cached:])
        vs.append(v[cached:])
        qs.append(torch.randn(new, heads, D, generator=g))
        qsl.append(qsl[-1] + new)
        lens.append(L)
    # Padding token with slot -1 must not be stored anywhere.
    ks.append(torch.full((1, kv_heads, D), 1e6))
    vs.append(torch.full((1, kv_heads, D), 1e6))
    slots.append(-1)
    max_blocks = max(len(t) for t in tables)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots), query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables],
                                  dtype=torch.int32),
        max_query_len=max(n for _, n in shapes), max_seq_len=max(lens))
    store_kv_reference(torch.cat(ks), torch.cat(vs), k_cache, v_cache, meta.slot_mapping)
    assert k_cache.abs().max() < 1e5
    scale = D ** -0.5
    out = paged_attention_reference(torch.cat(qs), k_cache, v_cache, meta, scale)
    for i, (cached, new) in enumerate(shapes):
        ref = dense_causal(qs[i], full_k[i], full_v[i], scale)
        torch.testing.assert_close(out[qsl[i]:qsl[i + 1]], ref, rtol=1e-5, atol=1e-5)
