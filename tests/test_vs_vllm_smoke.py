"""bench/vs_vllm.py on the CPU: minivllm's offline workloads on a tiny model (--smoke), the
merge into one JSON, and the report's section from it. vLLM itself needs a GPU: its part
refuses a smoke run with a clear message, and the merged table says what it lacks."""

import json

import pytest

from bench import report, vs_vllm
from bench.workloads import workloads


def test_offline_merge_and_report(tmp_path):
    out = tmp_path / "2026-12-01-cpu-vs-vllm-smoke"
    assert vs_vllm.main(["offline", "--engine", "minivllm", "--smoke", "--out", str(out),
                         "--work", str(tmp_path / "work"), "--workloads",
                         "w1,w2,w5,w6,sweep"]) == 0
    off = json.loads((out / "offline_minivllm.json").read_text())
    assert off["benchmark"] == "vs_vllm_offline" and off["environment"]["git_commit"]
    assert set(off["best"]) == {"W1", "W2", "W5", "W6", "D1", "D2"} and not off.get("errors")
    # the decode sweep: a step's time from a 1-token and a (1 + steps)-token run
    d2 = [x for x in off["rows"] if x["workload"] == "D2"]
    assert d2 and d2[0]["batch"] == 2 and d2[0]["decode_ms_per_step"] == pytest.approx(
        1000 * (d2[0]["long_s"] - d2[0]["short_s"]) / d2[0]["steps"], abs=0.05)  # rounding
    assert off["best"]["D2"]["metric"] == "decode_ms_per_step"
    w5 = [x for x in off["rows"] if x["workload"] == "W5"]
    assert w5 and all(x["output_tokens"] == x["requests"] for x in w5)  # one token each
    assert off["best"]["W5"]["metric"] == "prompt_tok_per_s"
    # repetitions draw fresh prompts: no repeat is served from the prefix cache
    assert len({x["prompt_tokens"] for x in off["rows"] if x["workload"] == "W1"}) == 2

    with pytest.raises(SystemExit, match="vLLM needs a GPU"):
        vs_vllm.main(["offline", "--engine", "vllm", "--smoke", "--out", str(out), "--work",
                      str(tmp_path / "work")])
    assert not (out / "offline_vllm.json").exists()

    # A quantized run beside it: its own file, its own rows in the merged table.
    assert vs_vllm.main(["offline", "--engine", "minivllm", "--smoke", "--out", str(out),
                         "--work", str(tmp_path / "work"), "--workloads", "w2",
                         "--quantization", "int8"]) == 0
    quant = json.loads((out / "offline_minivllm_int8.json").read_text())
    assert quant["settings"]["quantization"] == "int8"

    assert vs_vllm.main(["merge", str(out)]) == 0
    merged = json.loads((out / "vs_vllm.json").read_text())
    assert {x["workload"]: x for x in merged["rows"]}["W2 int8"]["minivllm"] == \
        quant["best"]["W2"]["value"]
    assert merged["offline"]["minivllm"]["settings"].get("quantization") is None
    assert merged["benchmark"] == "vs_vllm" and merged["model"] == "qwen2.5-0.5b-instruct"
    rows = {x["workload"]: x for x in merged["rows"]}
    assert rows["W1"]["minivllm"] == off["best"]["W1"]["value"]
    assert rows["W1"]["vllm"] is None and rows["W1"]["ratio"] is None
    assert [x["workload"] for x in merged["rows"]][:6] == ["W1", "W2", "W5", "W6", "D1", "D2"]
    assert rows["D2"]["metric"] == "decode_ms_per_step"

    # A file another commit's run left in the folder (a reused machine's /tmp): merged
    # without --commit, left out with this run's.
    stale = dict(off, environment=dict(off["environment"], git_commit="0123abc"))
    (out / "offline_vllm.json").write_text(json.dumps(stale))
    assert vs_vllm.main(["merge", str(out)]) == 0
    assert {x["workload"]: x for x in json.loads((out / "vs_vllm.json").read_text())["rows"]
            }["W1"]["vllm"] == off["best"]["W1"]["value"]
    assert vs_vllm.main(["merge", str(out), "--commit", off["environment"]["git_commit"]]) == 0
    merged = json.loads((out / "vs_vllm.json").read_text())
    assert {x["workload"]: x for x in merged["rows"]}["W1"]["vllm"] is None
    assert merged["offline"]["vllm"] is None
    (out / "offline_vllm.json").unlink()

    md = report.render([tmp_path], tmp_path / "report", base=tmp_path).read_text()
    assert "## minivllm against vLLM" in md
    assert "| W1 | output_tok_per_s |" in md
    assert "| D2 | decode_ms_per_step |" in md
    assert "qwen2.5-0.5b-instruct W1, output tok/s | vLLM | not measured" in md


def test_offline_ab_interleaves_variants(tmp_path):
    """bench/offline_ab.py: each variant in processes of its own, in turn, with its
    environment and flags; every process's best repetition in ab.json and the table."""
    from bench import offline_ab

    assert offline_ab.parse_variant("g;MINIVLLM_PDL=0 X=1;--max-graph-tokens 0") == {
        "label": "g", "env": {"MINIVLLM_PDL": "0", "X": "1"},
        "flags": ["--max-graph-tokens", "0"]}
    out = tmp_path / "ab"
    assert offline_ab.main(["--smoke", "--workloads", "w2", "--processes", "1",
                            "--variant", "eager-steps;;--max-graph-tokens 0",
                            "--variant", "plain;MINIVLLM_PDL=0", "--out", str(out),
                            "--work", str(tmp_path / "work")]) == 0
    ab = json.loads((out / "ab.json").read_text())
    assert list(ab["runs"]) == ["eager-steps", "plain"]
    for label in ("eager-steps", "plain"):
        (run,) = ab["runs"][label]
        assert run["rc"] == 0 and run["best"]["W2"] > 0
    graphs = json.loads(next((out / "eager-steps" / "p0").glob("*.json")).read_text())
    assert graphs["settings"]["max_graph_tokens"] == 0
    with pytest.raises(SystemExit, match="label"):
        offline_ab.parse_variant(";X=1")


def test_each_round_and_setting_gets_its_own_prompts():
    """--rounds: a round's runs have round 0's prompt and output lengths but prompt ids no
    earlier run had, so the prefix cache serves none of them; within a round, greedy and a
    setting share the lengths (their times compare) but not the ids."""
    w = workloads(True, 1000)["W1"]
    reqs = w.requests(0)
    greedy0 = vs_vllm.with_sampling(reqs, w, "W1-0", "greedy")
    assert greedy0 == reqs
    runs = [vs_vllm.with_sampling(reqs, w, "W1-0", s, r)
            for s in ("greedy", "top_p") for r in (0, 1, -1) if (s, r) != ("greedy", 0)]
    for run in runs:
        assert [len(p) for p, _ in run] == [len(p) for p, _ in reqs]
        assert [o for _, o in run] == [o for _, o in reqs]
    ids = [tuple(map(tuple, (p for p, _ in run))) for run in [greedy0] + runs]
    assert len(set(ids)) == len(ids)


def test_workloads_are_shortened_to_fit_a_models_context(tiny_model_dirs):
    """A model's own context shorter than a workload's longest request (Gemma 2's 8,192
    against W6's 8,448; GPT-2's 1,024 against W1's 2,048): every request of it fits, W6
    keeps its 256-token decode past a shorter prompt, and a context that fits changes
    nothing. The engine takes a request that fills its context exactly."""
    full = {n: (w.prompt, w.output) for n, w in workloads(False, 1000).items()}
    assert {n: (w.prompt, w.output) for n, w in workloads(False, 1000, 8704).items()} == full
    for context in (8192, 1024):
        for name, w in workloads(False, 1000, context).items():
            assert w.prompt[1] + w.output[1] <= context, (name, context)
            assert all(len(p) + o <= context for p, o in w.requests(0, 4))
    assert workloads(False, 1000, 8192)["W6"].prompt == (7936, 7936)
    assert workloads(False, 1000, 8192)["W6"].output == (256, 256)
    assert workloads(False, 1000, 1024)["W1"].output[1] <= 512
    from minivllm import LLM, SamplingParams
    llm = LLM(str(tiny_model_dirs["llama"]), skip_tokenizer_init=True, max_model_len=64)
    out = llm.generate([list(range(10, 58))], SamplingParams(temperature=0, max_tokens=16,
                                                              ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 16


@pytest.mark.parametrize("window", [None, 32])
def test_kv_blocks_per_sequence_stay_flat_past_a_sliding_window(tmp_path, window):
    """kv_blocks_per_seq_peak as W6 reports it: a Mistral whose every layer has a window
    holds about window / block size blocks a sequence however long it runs; without one,
    its whole context."""
    from bench.gpu_check import SMOKE_CONFIG

    folder = tmp_path / "mistral"
    folder.mkdir()
    cfg = {**SMOKE_CONFIG, "architectures": ["MistralForCausalLM"], "model_type": "mistral",
           "sliding_window": window, "rope_theta": 1e4}
    (folder / "config.json").write_text(json.dumps(cfg))
    engine = vs_vllm.MinivllmEngine(folder, smoke=True)
    engine.watch_kv = True
    prompt, out = 120, 40
    requests = [(list(range(first, first + prompt)), out) for first in (3, 200)]
    assert engine.generate(requests) == [out, out]
    context_blocks = -(-(prompt + out) // 16)
    if window is None:
        assert engine.kv_blocks_per_seq == context_blocks
    else:
        assert engine.kv_blocks_per_seq <= window // 16 + 2 < context_blocks
