"""Time the attention kernels on the shape of a mixed-step CUDA graph (GPU only).

A server under load runs many mixed steps: decode rows plus one new prompt, padded to a
token bucket and to max_num_seqs sequences. This times one layer's paged_attention on that
padded shape (Qwen2.5-0.5B heads), on the same batch unpadded, and paged_attention_decode on
the decode rows alone. Each is captured in a CUDA graph and replayed, so the numbers are
device time, not Python launch overhead (an eager loop measured the host).

    python -m bench.mixed_attention_timing [--out FILE]
"""

from __future__ import annotations

import json

import torch

from bench.common import gpu_probe_parser, graph_replay_us, has_cuda, write_result


def main(argv=None) -> int:
    args = gpu_probe_parser(__doc__).parse_args(argv)
    if not has_cuda("mixed_attention_timing"):
        return 1
    from csrc_triton import paged_attention, paged_attention_decode

    dev, dt = torch.device("cuda"), torch.bfloat16
    hq, hkv, d, bs = 14, 2, 64, 16
    max_seqs, bucket, max_len = 256, 256, 1024
    decodes, prompt = 40, 128
    seq_lens = [200 + 3 * i for i in range(decodes)] + [prompt] + [0] * (max_seqs - decodes - 1)
    q_lens = [1] * decodes + [prompt] + [0] * (max_seqs - decodes - 1)
    blocks_per = max_len // bs
    nb = max_seqs * blocks_per
    k = torch.randn(nb, bs, hkv, d, device=dev, dtype=dt)
    v = torch.randn_like(k)
    bt = torch.arange(nb, device=dev, dtype=torch.int32).view(max_seqs, blocks_per)
    q = torch.randn(bucket, hq, d, device=dev, dtype=dt)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), device=dev, dtype=torch.int32)
    sl = torch.tensor(seq_lens, device=dev, dtype=torch.int32)

    timed = graph_replay_us

    real = decodes + 1
    n_tok = decodes + prompt
    res = {
        "shape": {"heads": [hq, hkv, d], "max_seqs": max_seqs, "bucket": bucket,
                  "decode_rows": decodes, "prompt_tokens": prompt, "max_seq_len": max_len},
        "mixed_graph_shape_us": timed(lambda: paged_attention(
            q, k, v, bt, sl, qsl, d ** -0.5, bucket, max_len)),
        "mixed_unpadded_us": timed(lambda: paged_attention(
            q[:n_tok], k, v, bt[:real], sl[:real], qsl[:real + 1], d ** -0.5, prompt,
            max(seq_lens))),
        "decode_rows_alone_us": timed(lambda: paged_attention_decode(
            q[:decodes], k, v, bt[:decodes], sl[:decodes], d ** -0.5, max_len)),
        "device": torch.cuda.get_device_name(), "torch": torch.__version__,
    }
    print(json.dumps(res, indent=1))
    if args.out:
        write_result("mixed_attention_timing", res, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
