"""The benchmark report regenerates from committed JSON alone, and the H200 W3 plumbing
(bench/w3_gpu.py) keeps its promises: a tokenizer that gives the same ids to every server,
and a time budget that shrinks or skips levels rather than overrunning."""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

pytest.importorskip("matplotlib")

from bench import report  # noqa: E402

RESULTS = REPO / "bench" / "results"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _envs(root: Path) -> list[dict]:
    out = []
    for p in root.rglob("*.json"):
        try:
            data = json.loads(p.read_text())
        except ValueError:
            continue
        if isinstance(data, dict) and isinstance(data.get("environment"), dict):
            out.append(data["environment"])
    return out


@pytest.fixture(scope="module")
def committed_report(tmp_path_factory):
    """(exit status, folder) of `python -m bench report` on the committed results, rendered
    once for the two tests that read it (the plots take matplotlib ~10 s). Run from the
    repository root, the entry point renders with base=REPO, as report.render([RESULTS],
    out, base=REPO)."""
    from bench.__main__ import main

    out = tmp_path_factory.mktemp("report")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(REPO)
        status = main(["report", "--results", str(RESULTS), "--out", str(out)])
    return status, out


def test_report_regenerates_from_committed_results(committed_report):
    status, out = committed_report
    assert status == 0
    md = (out / "report.md").read_text()
    pngs = sorted(out.glob("*.png"))
    assert pngs, "no plots"
    for p in pngs:
        assert p.read_bytes()[:8] == PNG_MAGIC
        assert f"({p.name})" in md, f"{p.name} not linked from the report"
    # Every committed GPU result names its GPU and versions in the report.
    envs = _envs(RESULTS)
    gpus = {str(e["gpu"]).split(",")[0] for e in envs if e.get("gpu")}
    assert gpus, "the committed results hold no GPU run"
    for gpu in gpus:
        assert gpu in md
    for e in envs:
        for k in ("torch", "transformers"):
            if e.get(k):
                assert f"{k} {e[k]}" in md
    if (RESULTS / "2026-11-29-h200-w1-w2-hf-peers" / "sweep.json").exists():
        assert (out / "sweep_ms_per_step.png").exists()
    assert any(p.name.startswith("w3_") and p.name.endswith("_throughput.png") for p in pngs)
    # vLLM measured beside minivllm: its section and headline rows, each with a ratio.
    assert "## minivllm against vLLM" in md
    assert re.search(r"\| llama-3.1-8b W2, output tok/s \| vLLM [0-9.]+ \| [0-9.,]+ \| [0-9.]+x \|", md)
    # ... and below the headline, each of those runs' GPU, date and commit.
    assert re.search(r"\nvs vLLM: .*llama-3.1-8b \(NVIDIA H200, 2026-\d\d-\d\d, commit [0-9a-f]{7}\)", md)
    assert "## Headline" in md and "## Not measured" in md
    # One-engine A/B folders, the tile sweep and the step profile have sections of their own.
    ab = re.search(r"### `bench/results/2026-12-01-h200-prefill-host-inputs`\n\n(.*?)\n\n", md,
                   re.S)
    assert ab and ab.group(1).count("| w5_") == 8
    assert "## Prefill attention tiles and step profiles" in md
    assert re.search(r"\| qwen3-0.6b \| w6-?\w* \| [0-9,]+ \| [0-9,]+ \|", md)
    assert "_prefill_kernel" in md
    assert re.search(r"\| lookup \| single stream \| ngram \| [0-9.,]+ \| [0-9.,]+ \| [0-9.]+x \|", md)


def test_missing_sections_are_reported_not_measured(tmp_path):
    src = tmp_path / "results" / "run1"
    src.mkdir(parents=True)
    shutil.copy(RESULTS / "2026-11-29-h200-w1-w2-hf-peers" / "sweep.json", src / "sweep.json")
    (src / "w1.error.txt").write_text("Traceback ...\nRuntimeError: boom\n")
    md = report.render([tmp_path / "results"], tmp_path / "out", base=tmp_path).read_text()
    for what in ("W1 (minivllm)", "W2 (minivllm)", "W3", "W4", "parity (fp32 vs HF)",
                 "bf16 vs HF bf16", "CUDA graphs vs eager", "vLLM"):
        assert f"**{what}: not measured.**" in md, what
    assert "RuntimeError: boom" in md  # the failure's reason, not a number
    assert "| W1 offline, output tok/s | minivllm | not measured | - |" in md
    assert (tmp_path / "out" / "sweep_ms_per_step.png").exists()
    assert "NVIDIA H200" in md


def _level(c, tok_s, failures=0, mem=None):
    return {"concurrency": c, "num_requests": 2 * c, "completed": 2 * c - failures,
            "failures": failures, "errors": [], "output_tok_per_s": tok_s,
            "ttft_ms_p50": 10.0 + c, "ttft_ms_p99": 20.0 + c, "itl_ms_p50": 3.0,
            "itl_ms_p99": 6.0, "tpot_ms_mean": 3.1, "tokens_per_event": 1.0,
            "peak_gpu_mem_gib": mem}


def _w3_file(path: Path, label: str, kind: str, levels: list, ramp=None,
             launch_cmd: str | None = None, date: str = "2030-01-01 00:00:00 UTC") -> None:
    env = {"date": date, "git_commit": "abc1234",
           "gpu": "NVIDIA H200, 143771 MiB, 570.00", "torch": "2.11.0+cu130",
           "triton": "3.6.0", "transformers": "5.17.0", "python": "3.12.3"}
    payload = {"benchmark": "w3_serve", "environment": env,
               "workload": {"prompt_tokens": 128, "output_tokens": 128, "rounds": 2.0,
                            "min_requests": 4, "model": "qwen2.5-0.5b-instruct",
                            "dtype": "bfloat16", "weights": "dummy (random)"},
               "targets": [{"label": label, "kind": kind, "levels": levels,
                            "launch_cmd": launch_cmd}]}
    if ramp:
        payload["ramp"] = ramp
    path.write_text(json.dumps(payload))


def test_w3_gpu_run_headline_ratios_and_ramp(tmp_path):
    run = tmp_path / "results" / "h200"
    run.mkdir(parents=True)
    cs = [1, 8, 64, 256]
    _w3_file(run / "w3_minivllm.json", "minivllm", "minivllm",
             [_level(c, 100.0 * c, mem=40.0) for c in cs],
             ramp={"levels": [_level(512, 30000.0), _level(1024, 0.0, failures=3)],
                   "cap": 1024, "memory_budget": "--gpu-memory-utilization 0.3",
                   "server_args": "--max-num-seqs 256", "first_failure": 1024,
                   "max_concurrency_without_failure": 512, "stopped_by": None,
                   "reached_cap": False})
    _w3_file(run / "w3_minivllm-offline.json", "minivllm-offline", "offline",
             [_level(c, 110.0 * c) for c in cs])
    _w3_file(run / "w3_transformers-cb.json", "transformers-cb", "transformers",
             [_level(c, 20.0 * c, mem=60.0) for c in cs])
    _w3_file(run / "w3_transformers.json", "transformers", "transformers",
             [_level(c, 40.0) for c in (1, 8)])
    out = tmp_path / "out"
    md = report.render([tmp_path / "results"], out, base=tmp_path).read_text()
    # c=64: server 6400, offline 7040 (91%), transformers-cb 1280 (5x); plain at c=8 only.
    assert "| W3 serving (GPU), out tok/s at c=64 | minivllm server | 6,400 | - |" in md
    assert "0.91x (server ÷ offline" in md
    assert "| W3 serving (GPU), out tok/s at c=64 | transformers serve --continuous-batching | " \
           "1,280 | 5.00x |" in md
    assert "transformers serve (at c=8, where both were measured) | 40.0 | 20.00x |" in md
    assert "= 91% (within 20%" in md
    assert "**Largest concurrency held with no failed request: 512**" in md
    assert "first failure came at concurrency 1024" in md
    for kind in ("throughput", "ttft", "itl", "gpu_mem"):
        assert (out / f"w3_results-h200_{kind}.png").exists(), kind
    assert "NVIDIA H200" in md and "commit abc1234" in md and "qwen2.5-0.5b-instruct" in md


def test_w3_headline_skips_a_run_with_non_default_engine_flags(tmp_path):
    """A newer run whose server had extra engine flags (an experiment) is reported, but the
    headline keeps the newest run with the default engine."""
    std = "python -m minivllm.server --model m --load-format dummy --max-num-seqs 256"
    for name, flags, rate, date in (("old", "", 100.0, "2030-01-01 00:00:00 UTC"),
                                    ("new", " --max-num-batched-tokens 1024", 300.0,
                                     "2030-01-02 00:00:00 UTC")):
        run = tmp_path / "results" / name
        run.mkdir(parents=True)
        _w3_file(run / "w3_minivllm.json", "minivllm", "minivllm", [_level(64, rate * 64)],
                 launch_cmd=std + flags, date=date)
        _w3_file(run / "w3_minivllm-offline.json", "minivllm-offline", "offline",
                 [_level(64, 110.0 * 64)], date=date)
    md = report.render([tmp_path / "results"], tmp_path / "out", base=tmp_path).read_text()
    assert "| W3 serving (GPU), out tok/s at c=64 | minivllm server | 6,400 | - |" in md
    assert "non-default flags (--max-num-batched-tokens): it is not used for the headline" in md
    assert "19,200" in md  # the experiment's own section still shows it


def test_w3_server_variants_and_engine_trace(tmp_path):
    """A minivllm-* label is a variant of the server (beside it, against the offline
    engine), not a peer; levels carrying the engine's step trace get its table."""
    run = tmp_path / "results" / "h200"
    run.mkdir(parents=True)
    traced = _level(64, 5000.0)
    traced["engine"] = {"iterations": 900, "in_step_share": 0.8,
                        "between_steps_ms_mean": 0.4, "longest_iteration_ms": 42.0,
                        "add_arrival_to_engine_ms_mean": 1.5,
                        "add_arrival_to_engine_ms_p90": 3.0,
                        "by_path": {"mixed_graph": {"share": 0.25, "mean_ms": 3.2,
                                                    "tokens_mean": 170.0},
                                    "decode_pipelined": {"share": 0.75, "mean_ms": 1.3,
                                                         "tokens_mean": 40.0}}}
    traced.update(server_intake_ms_mean=0.9, gpu_util_mean=71.5, server_cpu=[
        {"name": "minivllm-engine", "pid": 2, "share": 0.93,
         "threads": [{"name": "minivllm-engine", "share": 0.93}]},
        {"name": "root:python3", "pid": 1, "share": 0.9,
         "threads": [{"name": "python3", "share": 0.6}, {"name": "mv-receiver", "share": 0.3}]},
        {"name": "python3", "pid": 3, "share": 0.0, "threads": []}])
    _w3_file(run / "w3_minivllm.json", "minivllm", "minivllm", [traced])
    _w3_file(run / "w3_minivllm-api2.json", "minivllm-api2", "minivllm", [_level(64, 6000.0)])
    _w3_file(run / "w3_minivllm-mixedpipe.json", "minivllm-mixedpipe", "minivllm",
             [_level(64, 7000.0)])
    _w3_file(run / "w3_minivllm-offline.json", "minivllm-offline", "offline",
             [_level(64, 8000.0)])
    md = report.render([tmp_path / "results"], tmp_path / "out", base=tmp_path).read_text()
    assert "| minivllm server (--api-servers 2) | 6,000 | 0.75x (÷ offline) |" in md
    assert "| minivllm server (minivllm-mixedpipe) | 7,000 | 0.88x (÷ offline) |" in md
    assert "÷ minivllm-api2" not in md and "÷ minivllm-mixedpipe" not in md  # not peers
    assert "`minivllm-mixedpipe` (minivllm-mixedpipe) vs offline engine at concurrency 64: " \
           "7,000 vs 8,000 tok/s = 88%." in md
    assert "| minivllm | 64 | 900 | mixed_graph 25% x 3.2 ms (170.0 tok); decode_pipelined 75% " \
           "x 1.3 ms (40.0 tok) | 0.8 | 0.4 | 42.0 | 1.5 | 3.0 |" in md
    assert "| minivllm | 64 | 0.9 | 71.5 | minivllm-engine 0.93; root:python3 0.9 (python3 0.6, " \
           "mv-receiver 0.3) |" in md  # idle processes left out


def test_python_m_bench_report_entry_point(committed_report):
    from bench.__main__ import main

    status, out = committed_report
    assert status == 0
    assert (out / "report.md").exists()
    assert main(["no-such-command"]) == 2


# ---- bench/w3_gpu.py ---------------------------------------------------------------------------

def test_w3_tokenizer_gives_every_loader_the_same_ids(tmp_path):
    """The dummy model's folder says qwen2, so AutoTokenizer builds Qwen2Tokenizer from
    tokenizer.json; the generic backend must agree with it, prompt characters must be
    exactly one token each, and every sampled id must decode to text."""
    from transformers import AutoTokenizer

    from bench import w3_gpu

    cfg = dict(w3_gpu.SMOKE_CONFIG)
    with_cfg = tmp_path / "with-config"
    with_cfg.mkdir()
    (with_cfg / "config.json").write_text(json.dumps(cfg))
    w3_gpu.write_tokenizer(with_cfg, cfg["vocab_size"])
    bare = tmp_path / "bare"
    shutil.copytree(with_cfg, bare)
    (bare / "config.json").unlink()
    args = w3_gpu.parse_args(["minivllm", "--smoke"])
    text = w3_gpu.Prompts(args, as_tokens=False).at(4)
    ids = w3_gpu.Prompts(args, as_tokens=True).at(4)
    assert len(text) == len(ids) >= 8 and all(len(t) == args.prompt_tokens for t in text)
    for folder in (with_cfg, bare):
        tok = AutoTokenizer.from_pretrained(str(folder))
        assert [tok.encode(t, add_special_tokens=False) for t in text] == ids
        assert [tok.encode(t) for t in text] == ids  # no BOS/EOS added either
        for i in (300, 511):
            assert tok.decode([i]) == f" t{i}"


def test_w3_client_temperature_unset_leaves_the_servers_defaults():
    """--client-temperature unset: the requests carry no temperature (the model's
    generation_config.json then samples them), only beside such a file."""
    from bench import serve_bench as sb
    from bench import w3_gpu

    genconfig = str(REPO / "bench" / "model_configs"
                    / "qwen2.5-0.5b-instruct.generation_config.json")
    args = w3_gpu.parse_args(["minivllm", "--smoke", "--generation-config-json", genconfig,
                              "--client-temperature", "unset"])
    assert args.client_temperature is None and w3_gpu.workload(args)["temperature"] is None
    t = sb.Target(label="x", kind="minivllm", base_url="http://127.0.0.1:1", model="m")
    saved = sb.CLIENT_TEMPERATURE
    try:
        sb.CLIENT_TEMPERATURE = None
        assert "temperature" not in sb.request_body(t, "hi", 4)
        sb.CLIENT_TEMPERATURE = 0.0
        assert sb.request_body(t, "hi", 4)["temperature"] == 0.0
    finally:
        sb.CLIENT_TEMPERATURE = saved
    for bad in (["--client-temperature", "unset"], ["--client-temperature", "-1"]):
        with pytest.raises(SystemExit):
            w3_gpu.parse_args(["minivllm", "--smoke", *bad])


def test_w3_budget_shrinks_then_skips_levels():
    from bench.w3_gpu import plan_level

    assert plan_level(64, 128, 128, None, 100) == (128, None)        # nothing known yet
    assert plan_level(64, 128, 128, 10000.0, 100) == (128, None)     # ~2 s: fits
    n, why = plan_level(64, 128, 128, 200.0, 60)                      # 98 s > 60: one round
    assert n == 64 and why is None
    n, why = plan_level(256, 512, 128, 100.0, 60)                     # even one round won't fit
    assert n is None and "would not fit" in why
    assert plan_level(8, 16, 128, None, 3)[0] is None                 # budget spent


def test_w3_plans_lower_levels_from_a_higher_one_in_proportion():
    """Concurrency 64 is measured first; a lower level's rate is then estimated down in
    proportion to c (so a slow peer's low levels are not planned as if at 64's rate)."""
    from bench.w3_gpu import estimated_rate

    assert estimated_rate(8, {}) is None
    assert estimated_rate(8, {64: 640.0}) == 80.0
    assert estimated_rate(128, {64: 640.0}) == 640.0                 # at or below: as is
    assert estimated_rate(32, {64: 640.0, 8: 200.0}) == 200.0


def test_w3_prompts_are_fresh_per_request_and_shared_across_parts():
    """minivllm caches prefixes: no prompt may repeat within a part (warm-up included), and
    level c must get the same prompts in the server, offline and transformers parts."""
    from bench import w3_gpu

    args = w3_gpu.parse_args(["minivllm", "--concurrency", "1", "8", "64", "--ramp", "128",
                              "--plain-concurrency", "1", "8"])
    p = w3_gpu.Prompts(args, as_tokens=False)
    seen = list(p.warm)
    for c in (1, 8, 64, 128):
        level = p.at(c)
        assert len(level) >= max(w3_gpu.requests_at(args, c), c)
        seen += level
    assert len(seen) == len(set(seen))
    other = w3_gpu.parse_args(["offline", "--concurrency", "1", "8", "64", "--ramp", "128",
                               "--plain-concurrency", "1", "8"])
    assert w3_gpu.Prompts(other, as_tokens=True).at(64) == [list(x.encode()) for x in p.at(64)]


def test_w1_best_skips_rows_run_with_engine_flags(tmp_path):
    """A W1 variant with engine flags (an A/B in one call) is listed beside the default
    engine's runs, but the default engine's best is the number the report stands on."""
    src = tmp_path / "results" / "run1"
    src.mkdir(parents=True)
    env = json.loads((RESULTS / "2026-11-29-h200-w1-w2-hf-peers" / "sweep.json").read_text())["environment"]
    rows = [{"engine": "minivllm", "run": 0, "seconds": 3.0, "output_tokens": 150000,
             "output_tok_per_s": 50000.0, "env": {}, "preemptions": 0},
            {"engine": "minivllm (no-prelude)", "run": 0, "seconds": 1.5,
             "output_tokens": 150000, "output_tok_per_s": 100000.0,
             "env": {"MINIVLLM_DECODE_PRELUDE": "0"}, "preemptions": 0}]
    (src / "w1.json").write_text(json.dumps({"section": "w1", "environment": env,
                                             "workload": {"requests": 256}, "rows": rows}))
    (src / "hf.json").write_text(json.dumps({"section": "hf", "environment": env, "rows": [
        {"engine": "HF generate_batch", "output_tok_per_s": 500.0, "seconds": 30.0}]}))
    md = report.render([tmp_path / "results"], tmp_path / "out", base=tmp_path).read_text()
    assert "| W1 offline, output tok/s | minivllm | 50,000 |" in md
    assert "minivllm (no-prelude) (run 0) | 100,000" in md
    assert "| HF generate_batch | 500.0 | 30.0 | - | 100.00x |" in md  # from 50,000, not 100,000


def test_decode_steps_one_table_per_folder(tmp_path):
    """bench.diagnostics.decode_steps files: a folder's runs side by side, a column per
    (batch, context) point, '-' where a run did not measure it."""
    src = tmp_path / "results" / "steps"
    src.mkdir(parents=True)
    env = {"date": "2026-12-03 07:00:00 UTC", "git_commit": "abcdef0123", "gpu": "NVIDIA H200"}
    for name, rows in (("a.json", [(1, 1024, 2.853), (8, 1024, 4.378)]),
                       ("b.json", [(8, 1024, 3.761)])):
        (src / name).write_text(json.dumps({
            "benchmark": "decode_steps", "model": "llama-3.1-8b", "quantization": "fp8",
            "environment": env,
            "rows": [{"batch": b, "context": c, "ms_per_step": ms} for b, c, ms in rows]}))
    md = report.render([tmp_path / "results"], tmp_path / "out", base=tmp_path).read_text()
    assert "llama-3.1-8b, fp8" in md
    assert "| file | commit | 1 x 1024 | 8 x 1024 |" in md
    assert "| `a.json` | abcdef0 | 2.85 | 4.38 |" in md
    assert "| `b.json` | abcdef0 | - | 3.76 |" in md


def test_kv_cache_fp8_and_decode_splits_tables(tmp_path):
    """bench.kv_cache_fp8: a row per point with both caches and their ratio, the capacities
    in the heading; bench.diagnostics.decode_splits: a column per split count, the engine's
    plan starred (over an explicit launch of the same count)."""
    src = tmp_path / "results" / "kv"
    src.mkdir(parents=True)
    env = {"date": "2026-12-03 09:00:00 UTC", "git_commit": "abcdef0123", "gpu": "NVIDIA H200"}
    rows = [{"kv_cache_dtype": kv, "batch": 64, "context": 8192, "ms_per_step": ms,
             "kv_cache_tokens": tokens} for kv, ms, tokens in (("auto", 20.0, 892224),
                                                               ("fp8", 13.4, 1792640))]
    (src / "kv.json").write_text(json.dumps({"benchmark": "kv-cache-fp8", "model": "llama-3.1-8b",
                                             "environment": env, "rows": rows}))
    splits = [{"batch": 64, "context": 8192, "cache": "float8_e4m3fn", "splits": s, "us": us}
              | extra for s, us, extra in ((3, 275.7, {"plan": True}), (1, 332.3, {}),
                                           (3, 281.0, {}))]
    (src / "splits.json").write_text(json.dumps({"benchmark": "decode_splits",
                                                 "environment": env, "rows": splits}))
    md = report.render([tmp_path / "results"], tmp_path / "out", base=tmp_path).read_text()
    assert "KV cache 892,224 tokens (model dtype) against 1,792,640 (e4m3)" in md
    assert "| 64 x 8192 | 20.00 | 13.40 | 0.67x |" in md
    assert "| batch x context | cache | 1 splits | 3 splits |" in md
    assert "| 64 x 8192 | float8_e4m3fn | 332.3 | 275.7* |" in md


def test_vs_vllm_older_run_stays_for_the_workloads_newer_runs_lack(tmp_path):
    """Of one model's fp8 runs against vLLM, the newest gives each cell it has (W2 fp8 from
    the run with the decode sweep); an older run stays for the workloads only it has (W1,
    W6 fp8), and a run whose workloads newer runs all cover is not shown."""
    fp8 = RESULTS / "2026-12-02-h200-vs-vllm-llama-3.1-8b-fp8" / "vs_vllm.json"
    sweep = RESULTS / "2026-12-03-h200-vs-vllm-llama-3.1-8b-fp8-decode-sweep" / "vs_vllm.json"
    if not (fp8.exists() and sweep.exists()):
        pytest.skip("the committed fp8 runs against vLLM are not in this tree")
    root = tmp_path / "results"
    for name, path in (("older", fp8), ("newer", sweep)):
        (root / name).mkdir(parents=True)
        shutil.copy(path, root / name / "vs_vllm.json")
    oldest = json.loads(fp8.read_text())
    oldest["environment"]["date"] = "2026-12-01 00:00:00 UTC"
    oldest["rows"] = [r for r in oldest["rows"] if r["workload"] == "W2 fp8"]
    for r in oldest["rows"]:
        r["minivllm"] = 123.4
    (root / "oldest").mkdir()
    (root / "oldest" / "vs_vllm.json").write_text(json.dumps(oldest))
    md = report.render([root], tmp_path / "out", base=tmp_path).read_text()
    headline = md.split("\n## ")[1]
    assert "| llama-3.1-8b W2 fp8, output tok/s | minivllm | 375.5 | - |" in headline
    assert "| llama-3.1-8b W1 fp8, output tok/s | minivllm | 11,880 | - |" in headline
    assert "| llama-3.1-8b W6 fp8, output tok/s | minivllm | 1,011 | - |" in headline
    assert headline.count("W2 fp8, output tok/s | minivllm") == 1
    assert "123.4" not in md and "359.2" not in headline
