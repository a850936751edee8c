"""bench.pyspy_summary on a small folded-stack file in py-spy's raw --threads format."""

from bench import pyspy_summary


def test_self_and_inclusive_shares_per_thread(tmp_path, capsys):
    f = tmp_path / "raw.txt"
    f.write_text("thread (1): MainThread;main (a.py:1);step (b.py:2);sync (c.py:3) 6\n"
                 "thread (1): MainThread;main (a.py:1);send (d.py:4) 2\n"
                 "thread (2): mv-receiver;recv (e.py:5) 2\n")
    threads = pyspy_summary.load(f)
    assert set(threads) == {"thread (1): MainThread", "thread (2): mv-receiver"}
    lines = pyspy_summary.summarize(threads["thread (1): MainThread"], top=3)
    assert lines[0].strip() == "8 samples"
    body = "\n".join(lines)
    assert " 75.0%  sync (c.py:3)" in body and " 25.0%  send (d.py:4)" in body
    assert "100.0%  main (a.py:1)" in body  # inclusive
    assert pyspy_summary.main([str(f), "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert out.index("MainThread") < out.index("mv-receiver")  # busiest thread first
