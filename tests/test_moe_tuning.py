"""bench/moe_tuning.py on tiny experts in the interpreter: a candidate whose output is wrong
is dropped, the best tiles land in the table under the shape's key, and moe_tiles reads them
back from it (pick_tiles, moe_tiles' lookup)."""

import json

import torch

from bench import moe_tuning
from csrc_triton import moe as K


def test_tuning_keeps_correct_tiles_and_moe_tiles_reads_them(tmp_path, monkeypatch):
    gemm = K._gemm

    def broken_at_16(mod, a, w, *args):  # BLOCK_N 16 (the first candidate) computes garbage
        gemm(mod, a, w, *args)
        if args[-1]["BLOCK_N"] == 16:
            args[2].zero_()  # out

    monkeypatch.setattr(K, "_gemm", broken_at_16)
    table = tmp_path / "tiles.json"
    assert moe_tuning.main(["--smoke", "--table", str(table)]) == 0
    entries = json.loads(table.read_text())["cpu (smoke)"]
    w13 = torch.empty(4, 48, 32, dtype=torch.bfloat16)
    [key] = entries
    assert key == K.tiles_key(w13, 2)
    assert sorted(entries[key], key=int) == ["2", "18"]  # T = 1 and 9, top-2
    for tiles in entries[key].values():
        assert tiles["w13"]["BLOCK_N"] == tiles["w2"]["BLOCK_N"] == 32
    assert K.pick_tiles(entries[key], 48, 5) == entries[key]["18"]
