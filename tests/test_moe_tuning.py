"""bench/moe_tuning.py on tiny experts in the interpreter: a candidate whose output is wrong
is dropped, the best tiles land in the table under the shape's key, and moe_tiles reads them
back from it (pick_tiles, moe_tiles' lookup)."""

import json

import torch

from bench import moe_tuning
from csrc_triton import moe as K


def test_tuning_keeps_correct_tiles_and_moe_tiles_reads_them(tmp_path, monkeypatch):
    gemm, rows_gemm = K._gemm, K._rows_gemm

    def broken_at_16(mod, a, w, *args):  # BLOCK_N 16 (the first candidate) computes garbage
        gemm(mod, a, w, *args)
        if args[-1]["BLOCK_N"] == 16:
            args[2].zero_()  # out

    def broken_rows(mod, a, w, w_scale, out, *args):  # and so does the rows path
        rows_gemm(mod, a, w, w_scale, out, *args)
        out.zero_()

    monkeypatch.setattr(K, "_gemm", broken_at_16)
    monkeypatch.setattr(K, "_rows_gemm", broken_rows)
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


def test_the_rows_path_is_a_candidate_at_decode_sizes(tmp_path):
    """Up to 64 rows the rows path (BLOCK_M 1) is tried with its own tiles; untimed (the
    interpreter), the first correct candidate stands, and it is the rows path."""
    table = tmp_path / "tiles.json"
    assert moe_tuning.main(["--smoke", "--table", str(table)]) == 0
    [entries] = json.loads(table.read_text())["cpu (smoke)"].values()
    for tiles in entries.values():
        assert tiles["BLOCK_M"] == 1 and tiles["w13"]["BLOCK_N"] == 8
