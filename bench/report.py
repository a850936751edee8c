"""The benchmark report: Markdown and PNG plots regenerated from committed JSON alone (no GPU).

    python -m bench report [--results DIR ...] [--out bench/results/report]

It reads every result file under the results folders (default bench/results, recursively):
bench.gpu_check sections (parity, graphs, bf16, w2, sweep, w1, hf, and their *.error.txt),
W3 serving runs (bench.serve_bench / bench.w3_gpu: "benchmark": "w3_serve"; the files of one
folder form one run) and W4 (bench.w4_cpu). It writes report.md and the plots beside it:
throughput, TTFT and ITL p50/p99 and peak GPU memory against concurrency (W3, per engine),
decode ms/step against batch size beside the HBM floor (sweep), and the W1/W2 tables with
every peer measured in the same run and the ratios. Every figure and table names the GPU (or
CPU), the versions, the model config and the commit, from the JSON's environment. What no
file holds is reported as "not measured" — never estimated.
"""

from __future__ import annotations

import argparse
import io
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from bench import roofline

BENCH_DIR = Path(__file__).resolve().parent
RESULTS_DIR = BENCH_DIR / "results"
DEFAULT_OUT = RESULTS_DIR / "report"
GPU_SECTIONS = ("parity", "graphs", "bf16", "w2", "sweep", "w1", "hf")
NOT_MEASURED = "not measured"
W3_TARGET_CONCURRENCY = 64
VLLM_HOWTO = (
    "No committed result measures vLLM yet. To measure it with the same client, start it "
    "(`vllm serve MODEL --load-format dummy --dtype bfloat16 --max-model-len 1024 "
    "--generation-config vllm`, with --skip-tokenizer-init for token-id prompts), then "
    "`python -m bench serve --base-url http://127.0.0.1:8000/v1 --kind vllm --label vllm "
    "--prompt-mode tokens --vocab-size 32000 --concurrency 1 16 64 256 --out "
    "DIR/w3_vllm.json` beside the run's other results, and rerun `python -m bench report`.")


# ---- loading ------------------------------------------------------------------------------------

@dataclass
class Result:
    path: Path
    data: dict

    @property
    def env(self) -> dict:
        return self.data.get("environment") or {}

    @property
    def date(self) -> str:
        return str(self.env.get("date") or "")

    @property
    def run(self) -> Path:
        return self.path.parent


@dataclass
class Results:
    sections: dict[str, list[Result]] = field(default_factory=dict)   # gpu_check
    errors: dict[str, list[Path]] = field(default_factory=dict)       # <section>.error.txt
    w3: dict[Path, list[Result]] = field(default_factory=dict)        # run folder -> files
    w4: list[Result] = field(default_factory=list)
    vs_vllm: list[Result] = field(default_factory=list)                # bench.vs_vllm merge
    offline: dict[Path, list[Result]] = field(default_factory=dict)   # one engine, A/B runs
    tuning: list[Result] = field(default_factory=list)                # attention_tuning
    profiles: list[Result] = field(default_factory=list)              # bench.step_profile
    host_cpu: list[Result] = field(default_factory=list)              # bench.engine_host_cpu
    w7: list[Result] = field(default_factory=list)                    # bench.w7_spec
    quant: list[Result] = field(default_factory=list)                 # bench.quant_accuracy
    decode_steps: dict[Path, list[Result]] = field(default_factory=dict)  # folder -> files
    kv_cache_fp8: list[Result] = field(default_factory=list)          # bench.kv_cache_fp8
    decode_splits: list[Result] = field(default_factory=list)  # diagnostics.decode_splits
    ignored: list[Path] = field(default_factory=list)

    def newest(self, section: str) -> Result | None:
        found = self.sections.get(section) or []
        # GPU results first (a CPU smoke run must not hide them), then the newest.
        return max(found, key=lambda r: (bool(r.env.get("gpu")), r.date, str(r.path))) \
            if found else None

    def newest_with_peers(self, section: str, has_peer) -> Result | None:
        """The newest `section` result whose run folder also holds its peers (has_peer(hf
        result) is true); else the newest. Ratios only compare results of one run."""
        found = [r for r in self.sections.get(section) or []
                 if (hf := self.in_run("hf", r.run)) is not None and has_peer(hf)]
        if not found:
            return self.newest(section)
        return max(found, key=lambda r: (bool(r.env.get("gpu")), r.date, str(r.path)))

    def in_run(self, section: str, run: Path) -> Result | None:
        return next((r for r in self.sections.get(section, []) if r.run == run), None)


# A result file's "benchmark" -> the Results list it joins, or the dict of lists by folder.
LISTED = {"vs_vllm": "vs_vllm", "w4_cpu": "w4", "attention-tuning": "tuning",
          "step_profile": "profiles", "w7-spec": "w7", "quant-accuracy": "quant",
          "kv-cache-fp8": "kv_cache_fp8", "decode_splits": "decode_splits",
          "engine_host_cpu": "host_cpu"}
BY_FOLDER = {"w3_serve": "w3", "vs_vllm_offline": "offline", "decode_steps": "decode_steps"}


def load(dirs: list[Path], skip: Path | None = None) -> Results:
    res = Results()
    skip = skip.resolve() if skip else None
    files = []
    for d in dirs:
        d = Path(d)
        files += [d] if d.is_file() else sorted(d.rglob("*"))
    for p in files:
        if not p.is_file() or (skip and skip in p.resolve().parents):
            continue
        if p.name.endswith(".error.txt"):
            section = p.name[: -len(".error.txt")]
            if section in GPU_SECTIONS:
                res.errors.setdefault(section, []).append(p)
            continue
        if p.suffix != ".json":
            continue
        try:
            data = json.loads(p.read_text())
        except (OSError, ValueError):
            res.ignored.append(p)
            continue
        if not isinstance(data, dict):
            res.ignored.append(p)
            continue
        r = Result(p, data)
        if data.get("section") in GPU_SECTIONS:
            res.sections.setdefault(data["section"], []).append(r)
        elif data.get("benchmark") in LISTED:
            getattr(res, LISTED[data["benchmark"]]).append(r)
        elif data.get("benchmark") in BY_FOLDER:
            getattr(res, BY_FOLDER[data["benchmark"]]).setdefault(p.parent, []).append(r)
        else:
            res.ignored.append(p)
    return res


# ---- formatting ---------------------------------------------------------------------------------

def fmt(v, digits: int = 1) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, float):
        if abs(v) >= 1000:
            return f"{v:,.0f}"
        return f"{v:,.{digits}f}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


# The engine flags every W3 run passes (bench/w3_gpu.py); any other flag on the minivllm
# server's command line makes the run an experiment with a non-default engine.
W3_STANDARD_FLAGS = {"--disable-log-requests", "--log-level", "--model", "--load-format",
                     "--seed", "--dtype", "--max-model-len", "--max-num-seqs",
                     "--gpu-memory-utilization", "--host", "--port", "--skip-tokenizer-init",
                     "--device", "--api-servers"}


def extra_engine_flags(targets: list) -> list[str]:
    """Flags beyond W3's standard ones on the run's minivllm server command line."""
    for t, _ in targets:
        if t.get("label") == "minivllm" and t.get("launch_cmd"):
            return [a for a in t["launch_cmd"].split()
                    if a.startswith("--") and a.split("=")[0] not in W3_STANDARD_FLAGS]
    return []


def is_server_variant(label: str) -> bool:
    """minivllm's server run another way (label minivllm-*), not a peer."""
    return label.startswith("minivllm-") and label != "minivllm-offline"


def variant_title(label: str) -> str:
    if label.startswith("minivllm-api") and label[len("minivllm-api"):].isdigit():
        return f"--api-servers {label[len('minivllm-api'):]}"
    return label


def ratio(a, b) -> str:
    if not a or not b:
        return "-"
    return f"{a / b:.2f}x"


def table(headers: list[str], rows: list[list]) -> str:
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    for r in rows:
        out.append("| " + " | ".join(fmt(c) if not isinstance(c, str) else c for c in r) + " |")
    return "\n".join(out)


def rel(p: Path, base: Path) -> str:
    try:
        return str(p.resolve().relative_to(base.resolve()))
    except ValueError:
        return str(p)


def machine(env: dict) -> str:
    gpu = env.get("gpu")
    if gpu:
        return str(gpu).split(",")[0].strip()
    cpu = env.get("cpu") or env.get("machine") or env.get("platform") or "CPU"
    n = env.get("cpu_count")
    return f"CPU: {cpu}" + (f" ({n} cores)" if n else "")


def versions(env: dict) -> str:
    parts = []
    for k in ("torch", "triton", "transformers", "cuda", "python"):
        if env.get(k):
            parts.append(f"{k} {env[k]}")
    return ", ".join(parts)


def provenance(env: dict, model: str | None, source: str | None = None) -> str:
    """One line naming the machine, versions, model config, commit and date."""
    s = (f"{machine(env)}; {versions(env)}; model {model or '?'}; "
         f"commit {env.get('git_commit') or 'unknown'}; {env.get('date') or 'date unknown'}")
    return s + (f"; source `{source}`" if source else "")


def model_of(r: Result) -> str:
    d = r.data
    w = d.get("workload") or {}
    name = w.get("model") or d.get("model")
    if not name:
        name = next((t.get("model") for t in d.get("targets", []) if t.get("model")), None)
        if name:
            name = Path(str(name)).name
    dtype = w.get("dtype") or d.get("dtype")
    weights = w.get("weights")
    extra = ", ".join(x for x in (dtype, weights) if x)
    return f"{name} ({extra})" if name and extra else (name or "?")


def error_summary(paths: list[Path], base: Path) -> str:
    out = []
    for p in paths:
        try:
            lines = [ln for ln in p.read_text(errors="replace").splitlines() if ln.strip()]
        except OSError:
            lines = []
        last = lines[-1].strip() if lines else "?"
        out.append(f"`{rel(p, base)}`: {last[:240]}")
    return "; ".join(out)


# ---- plots --------------------------------------------------------------------------------------

class Plotter:
    def __init__(self, out: Path) -> None:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        self.plt = plt
        self.out = out
        self.files: list[Path] = []

    def save(self, fig, name: str, caption: str) -> str:
        wrapped = "\n".join(_wrap(caption, 120))
        fig.text(0.01, 0.01, wrapped, fontsize=6.5, va="bottom", ha="left", color="#444")
        fig.subplots_adjust(bottom=0.13 + 0.035 * wrapped.count("\n"))
        path = self.out / name
        # The plots travel with every device call: 80 dpi, and a palette of 64 colours
        # (line plots need no more; a quarter of the bytes of full colour).
        buf = io.BytesIO()
        fig.savefig(buf, dpi=80)
        self.plt.close(fig)
        from PIL import Image

        Image.open(buf).convert("RGB").quantize(colors=64).save(path, optimize=True)
        self.files.append(path)
        return name


def _wrap(text: str, width: int) -> list[str]:
    words, lines, cur = text.split(" "), [], ""
    for w in words:
        if cur and len(cur) + 1 + len(w) > width:
            lines.append(cur)
            cur = w
        else:
            cur = f"{cur} {w}" if cur else w
    return lines + ([cur] if cur else [])


def _slug(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", s).strip("-") or "run"


# ---- sections -----------------------------------------------------------------------------------

class Report:
    def __init__(self, res: Results, out: Path, base: Path, dirs: list[Path]) -> None:
        self.res = res
        self.dirs = dirs
        self.out = out
        self.base = base
        self.plot = Plotter(out)
        self.md: list[str] = []
        self.missing: list[str] = []
        self.headline: dict[str, dict] = {}

    def h(self, level: int, text: str) -> None:
        self.md += ["", "#" * level + " " + text, ""]

    def p(self, text: str) -> None:
        self.md.append(text)

    def not_measured(self, what: str, why: str = "", short: str | None = None) -> None:
        short = why if short is None else short
        self.missing.append(what + (f" ({short[:300]})" if short else ""))
        self.p(f"**{what}: {NOT_MEASURED}.**" + (f" {why}" if why else ""))

    def src(self, r: Result) -> str:
        return rel(r.path, self.base)

    # -- correctness --

    def correctness(self) -> None:
        self.h(2, "Correctness on the GPU")
        titles = {"parity": "fp32 greedy output vs HF transformers (same dummy weights)",
                  "graphs": "CUDA-graph decode vs eager decode (same engine, same dtype)",
                  "bf16": "bf16 greedy output vs HF transformers bf16"}
        names = {"parity": "parity (fp32 vs HF)", "graphs": "CUDA graphs vs eager",
                 "bf16": "bf16 vs HF bf16"}
        for sec, title in titles.items():
            self.h(3, title)
            r = self.res.newest(sec)
            if r is None:
                why = ""
                if self.res.errors.get(sec):
                    why = "The run failed: " + error_summary(self.res.errors[sec], self.base)
                self.not_measured(names[sec], why)
                continue
            rows = []
            data_rows = r.data.get("rows", [])
            with_ref = any("reference" in row for row in data_rows)
            for row in data_rows:
                div = [d for d in row.get("first_divergence", []) if d is not None]
                rows.append([row.get("model"), row.get("dtype")]
                            + ([row.get("reference", "enforce_eager engine")] if with_ref else [])
                            + [f"{row.get('identical')}/{row.get('total')}",
                               ", ".join(map(str, div)) if div else "none"])
            self.p(table(["model config", "dtype"] + (["compared with"] if with_ref else [])
                         + ["identical prompts", "first divergence (token index)"], rows))
            self.p(f"\n{r.data.get('new_tokens', '?')} new tokens per prompt. "
                   f"{provenance(r.env, 'dummy weights', self.src(r))}")

    # -- W1 / W2 --

    def w2(self) -> None:
        self.h(2, "W2: single-stream latency (batch 1, 128-token prompt, 256 output tokens)")
        r = self.res.newest_with_peers("w2", lambda hf: any(
            "generate_batch" not in x.get("engine", "") for x in hf.data.get("rows", [])))
        self._newer_note("w2", r, "tok_per_s")
        if r is None:
            why = ("The run failed: " + error_summary(self.res.errors["w2"], self.base)
                   if self.res.errors.get("w2") else "")
            self.not_measured("W2 (minivllm)", why)
            return
        ours = [x for x in r.data.get("rows", []) if x.get("tok_per_s")]
        best = max(ours, key=lambda x: x["tok_per_s"]) if ours else None
        hf = self.res.in_run("hf", r.run)
        peers = [x for x in (hf.data.get("rows", []) if hf else [])
                 if "generate_batch" not in x.get("engine", "")]  # the W2 rows
        rows = [[x["engine"], x.get("tok_per_s"), x.get("ms_per_token"), x.get("ttft_ms"), "-"]
                for x in ours]
        for x in peers:
            if "error" in x:
                rows.append([x["engine"], "failed", "-", "-", x["error"][:80]])
            else:
                rows.append([x["engine"], x.get("tok_per_s"), 1000 / x["tok_per_s"]
                             if x.get("tok_per_s") else None, "-",
                             ratio(best and best["tok_per_s"], x.get("tok_per_s"))])
        self.p(table(["engine", "tok/s", "ms/token", "TTFT ms",
                      "best minivllm ÷ this"], rows))
        self.p("")
        if hf is None:
            self.not_measured("W2 HF peers in the same run",
                              f"no hf.json in `{rel(r.run, self.base)}`")
        expected = ("HF generate eager", "HF generate static cache + compile")
        for e in expected:
            if hf is not None and not any(x.get("engine") == e for x in peers):
                self.not_measured(f"W2 peer {e}", "absent from this run's hf.json")
        self.p(f"\nHF ms/token here is total time / 256 (TTFT included). "
               f"{provenance(r.env, model_of(r), self.src(r))}")
        self.headline["W2"] = {
            "ours": best and (best["engine"], best["tok_per_s"]), "env": r.env,
            "peers": {x["engine"]: x.get("tok_per_s") for x in peers if "error" not in x},
            "expected": ["HF generate eager", "HF generate static cache + compile"]}

    def w1(self) -> None:
        self.h(2, "W1: offline throughput (256 requests, prompt and output lengths uniform in "
                  "[100, 1024])")
        r = self.res.newest_with_peers("w1", lambda hf: any(
            "generate_batch" in x.get("engine", "") and "error" not in x
            for x in hf.data.get("rows", [])))
        self._newer_note("w1", r, "output_tok_per_s")
        hf_any = self.res.newest("hf")
        if r is None:
            why = ("The run failed: " + error_summary(self.res.errors["w1"], self.base)
                   if self.res.errors.get("w1") else "")
            self.not_measured("W1 (minivllm)", why)
            hf = hf_any
        else:
            hf = self.res.in_run("hf", r.run)
        rows = []
        best = None
        our_slice = None  # minivllm on the slice of W1 that HF generate_batch runs
        if r is not None:
            runs = [x for x in r.data.get("rows", []) if x.get("output_tok_per_s")]
            full = [x for x in runs if not x.get("workload")]
            # a variant with engine flags (an A/B) is listed, not taken as our best
            best = max((x["output_tok_per_s"] for x in full if not x.get("env")), default=None)
            for x in full:
                rows.append([f"{x['engine']} (run {x.get('run')})", x["output_tok_per_s"],
                             x.get("seconds"), x.get("preemptions"), "-", "full W1"])
            for x in runs:
                if x.get("workload"):
                    if not x.get("env"):
                        our_slice = x
                    rows.append([x["engine"], x["output_tok_per_s"], x.get("seconds"),
                                 x.get("preemptions", "-"), "-", x["workload"]])
        peer = next((x for x in (hf.data.get("rows", []) if hf else [])
                     if "generate_batch" in x.get("engine", "")), None)
        # A peer on a slice is compared with minivllm on the same slice where the run has it.
        ours_vs_peer = best
        if peer is not None and peer.get("workload") and our_slice is not None:
            ours_vs_peer = our_slice["output_tok_per_s"]
        if peer is not None:
            if "error" in peer:
                rows.append([peer["engine"], "failed", "-", "-", "-", peer["error"][:80]])
            else:
                rows.append([peer["engine"], peer.get("output_tok_per_s"), peer.get("seconds"),
                             "-", ratio(ours_vs_peer, peer.get("output_tok_per_s"))
                             if r is not None else "-", peer.get("workload", "")])
        if rows:
            self.p(table(["engine", "output tok/s", "seconds", "preemptions",
                          "best minivllm ÷ this", "workload"], rows))
        if peer is None:
            self.not_measured("W1 peer HF generate_batch", "no generate_batch row in the run")
        if r is not None:
            self.p(f"\n{provenance(r.env, model_of(r), self.src(r))}")
            peer_label = peer and f"{peer['engine']} ({peer.get('workload', 'W1')})"
            self.headline["W1"] = {
                "ours": best and ("minivllm", best), "env": r.env,
                "peers": ({peer_label: peer.get("output_tok_per_s")}
                          if peer and "error" not in peer else {}),
                "expected": [] if peer and "error" not in peer else ["HF generate_batch"],
                # minivllm's own number on a peer's slice, shown and used for its ratio
                "ours_on_slice": ({peer_label: (our_slice["workload"], ours_vs_peer)}
                                  if peer and our_slice is not None and ours_vs_peer != best
                                  else {})}
        elif hf is not None and peer is not None:
            self.p(f"\nHF only: {provenance(hf.env, model_of(hf), self.src(hf))}")
        self.p("\nThe HF generate_batch row runs a slice of W1 (its `workload` column): at HF's "
               "speed the full W1 takes minutes. Its ratio is to minivllm on the same slice "
               "where the run has that row, else to minivllm's best full W1.")

    def _newer_note(self, section: str, shown: Result | None, key: str) -> None:
        """Say so when a newer run of `section` exists than the one shown with its peers."""
        newest = self.res.newest(section)
        if shown is None or newest is None or newest.path == shown.path:
            return
        best = max((x.get(key) or 0 for x in newest.data.get("rows", []) if not x.get("env")),
                   default=0)
        self.p(f"Shown: the newest run with its HF peers (`{rel(shown.run, self.base)}`). A "
               f"newer run without peers (`{rel(newest.run, self.base)}`, commit "
               f"{newest.env.get('git_commit', '?')}) measured {fmt(best)} at best.\n")

    # -- decode sweep --

    def sweep(self) -> None:
        self.h(2, "Decode step time against batch size, beside the HBM floor")
        r = self.res.newest("sweep")
        if r is None:
            self.not_measured("decode sweep", error_summary(self.res.errors.get("sweep", []),
                                                            self.base))
            return
        rows = r.data.get("rows", [])
        self.p(table(["batch", "context", "ms/step", "HBM floor ms", "floor / measured"],
                     [[x["batch"], x["context"], x["ms_per_step"], x["hbm_floor_ms"],
                       f"{100 * x['floor_fraction']:.0f}%"] for x in rows]))
        cap = provenance(r.env, model_of(r), self.src(r))
        plt = self.plot.plt
        fig, ax = plt.subplots(figsize=(7, 4.4))
        b = [x["batch"] for x in rows]
        ax.plot(b, [x["ms_per_step"] for x in rows], "o-", label="minivllm decode step")
        ax.plot(b, [x["hbm_floor_ms"] for x in rows], "s--",
                label="HBM floor (weights + KV bytes / 4.28 TB/s)")
        ax.set_xscale("log", base=2)
        ax.set_xticks(b, [str(x) for x in b])
        ax.set_xlabel("batch size (sequences)")
        ax.set_ylabel("ms per decode step")
        ctx = rows[0]["context"] if rows else "?"
        ax.set_title(f"Decode step vs batch, context {ctx} ({r.data.get('note', '')})",
                     fontsize=9)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        name = self.plot.save(fig, "sweep_ms_per_step.png", cap)
        self.p(f"\n![decode ms/step vs batch]({name})\n\n{cap}")

    # -- W3 --

    def w3(self) -> None:
        self.h(2, "W3: serving (streaming /v1/completions, closed loop per concurrency)")
        if not self.res.w3:
            self.not_measured("W3")
        gpu_runs = [run for run, rs in self.res.w3.items() if any(r.env.get("gpu") for r in rs)]
        if not gpu_runs:
            self.not_measured("W3 on a GPU", "no W3 result carries a GPU in its environment")
        runs = sorted(self.res.w3.items(), key=lambda kv: max(r.date for r in kv[1]),
                      reverse=True)
        runs.sort(key=lambda kv: not any(r.env.get("gpu") for r in kv[1]))  # GPU runs first
        # Plots for the newest default-engine run of each machine kind and for runs with
        # another engine; the A/B runs of minivllm's own variants get tables only.
        def default_engine(rs):
            return not extra_engine_flags([(t, r) for r in rs for t in r.data.get("targets", [])])

        def has_offline(rs):
            return any(t.get("label") == "minivllm-offline"
                       for r in rs for t in r.data.get("targets", []))

        # the run the headline's server-vs-offline row comes from, on each machine kind
        plotted = {next((run for run, rs in runs if bool(rs[0].env.get("gpu")) == gpu
                         and default_engine(rs) and (has_offline(rs) or not gpu)), None)
                   for gpu in (True, False)}
        plotted |= {run for run, rs in runs if any(
            not str(t.get("label", "")).startswith("minivllm")
            for r in rs for t in r.data.get("targets", []))}
        for run, rs in runs:
            self.w3_run(run, rs, plots=run in plotted)
        self.h(3, "vLLM")
        if any(t.get("kind") == "vllm" for rs in self.res.w3.values() for r in rs
               for t in r.data.get("targets", [])):
            self.p("vLLM results are included in the runs above (targets of kind `vllm`).")
        else:
            self.not_measured("vLLM", VLLM_HOWTO, short="no committed result yet; the W3 "
                              "section says how to measure it")

    def w3_run(self, run: Path, rs: list[Result], plots: bool = True) -> None:
        rs = sorted(rs, key=lambda r: str(r.path))
        env = max(rs, key=lambda r: r.date).env
        w = rs[0].data.get("workload", {})
        order = {"minivllm": 0, "minivllm-offline": 1, "transformers-cb": 2, "transformers": 3}
        targets = sorted(((t, r) for r in rs for t in r.data.get("targets", [])),
                         key=lambda tr: order.get(tr[0].get("label"), 9))
        title = f"{machine(env)}: `{rel(run, self.base)}`"
        self.h(3, title)
        models = sorted({model_of(r) for r in rs})
        cap = provenance(env, "; ".join(models), None)
        gen, temp = w.get("generation_config"), w.get("temperature", 0.0)
        sent = ("no temperature from the client" if temp is None
                else f"temperature {temp:g} from the client")
        keys = ("temperature",) * (temp is None) + ("top_p", "top_k", "min_p",
                                                     "repetition_penalty")
        sampling = (f"{sent}, the servers' defaults from the model's generation_config.json ("
                    + ", ".join(f"{k} {gen[k]}" for k in keys if k in gen) + ")"
                    if gen else "greedy" if not temp else sent)
        self.p(f"{w.get('prompt_tokens')} prompt + {w.get('output_tokens')} output tokens, "
               f"{sampling}, streamed; requests per level = max({w.get('min_requests')}, "
               f"{w.get('rounds')} x concurrency). {cap}. Files: "
               + ", ".join(f"`{self.src(r)}`" for r in rs))
        rows = []
        for t, r in targets:
            for lv in sorted(t.get("levels", []), key=lambda lv: lv["concurrency"]):
                if "skipped" in lv:
                    rows.append([t["label"], lv["concurrency"], "-", "-", "skipped: " +
                                 lv["skipped"]] + ["-"] * 9)
                    continue
                rows.append([t["label"], lv["concurrency"], lv.get("num_requests"),
                             lv.get("failures"), lv.get("output_tok_per_s"),
                             lv.get("ttft_ms_p50"), lv.get("ttft_ms_p99"), lv.get("itl_ms_p50"),
                             lv.get("itl_ms_p99"), lv.get("tpot_ms_mean"),
                             lv.get("tokens_per_event"), lv.get("peak_gpu_mem_gib"),
                             lv.get("client_cpu_share"), lv.get("server_ttft_ms_mean", "-"),
                             lv.get("server_running_mean", "-"),
                             "; ".join(lv.get("errors") or [])[:120] or "-"])
            if t.get("error"):
                lines = [ln.strip() for ln in t["error"].splitlines() if ln.strip()]
                self.p(f"\n- `{t['label']}` stopped with an error: "
                       f"{lines[0][:200]}" + (f" ... {lines[-1][-200:]}" if len(lines) > 1
                                              else ""))
        self.p("")
        self.p(table(["engine", "c", "requests", "failures", "out tok/s", "TTFT p50 ms",
                      "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms", "TPOT ms", "tok/chunk",
                      "peak GPU GiB", "client CPU", "server TTFT ms", "running",
                      "errors"], rows))
        self.p("\nPeak GPU memory is the whole GPU's used memory (nvidia-ml-py) during the "
               "level; minivllm reserves its KV pool up front (`--gpu-memory-utilization`). "
               "ITL is the gap between streamed chunks as the client receives them: a server "
               "that writes several chunks at once shows gaps near 0 (TPOT is the mean "
               "time per output token after the first). Client CPU: the load generator's "
               "CPU time over the level's wall time (one Python process: near 1.0 it may be "
               "what limits the level; with several client processes it is their sum). "
               "Server TTFT (mean) and running (mean number of requests the engine ran) "
               "come from the server's own /metrics during the level: a server TTFT far "
               "below the client's puts the difference in HTTP and the client.")
        self.w3_engine_trace(targets)
        self.w3_server_processes(targets)
        series = {t["label"]: [lv for lv in t.get("levels", []) if lv.get("output_tok_per_s")]
                  for t, _ in targets}
        series = {k: sorted(v, key=lambda lv: lv["concurrency"]) for k, v in series.items() if v}
        if series and plots:
            self.w3_plots(run, series, cap)
        self.w3_ratios(targets, env, headline=run not in {r.run for r in self.res.vs_vllm},
                       run=run)
        self.w3_ramp(rs, targets)

    def w3_engine_trace(self, targets: list) -> None:
        """Each server level's slice of the engine process's step trace, where the run has
        one (MINIVLLM_ENGINE_TRACE, bench/engine_trace.py)."""
        rows = []
        for t, _ in targets:
            for lv in sorted(t.get("levels", []), key=lambda lv: lv["concurrency"]):
                e = lv.get("engine")
                if not e or not e.get("iterations"):
                    continue
                kinds = "; ".join(f"{k} {v['share']:.0%} x {v['mean_ms']} ms "
                                  f"({v['tokens_mean']} tok)"
                                  for k, v in e.get("by_path", {}).items())
                rows.append([t["label"], lv["concurrency"], e["iterations"], kinds,
                             e.get("in_step_share"), e.get("between_steps_ms_mean"),
                             e.get("longest_iteration_ms", "-"),
                             e.get("add_arrival_to_engine_ms_mean", "-"),
                             e.get("add_arrival_to_engine_ms_p90", "-")])
        if not rows:
            return
        self.p("\nThe engine process's steps during each level (its step trace): the kinds of "
               "step with their share of the iterations, mean time and mean tokens; the share "
               "of the level spent inside steps; the mean time between steps (sending "
               "outputs, reading commands, idling); the longest loop iteration (a stall "
               "delays every request arriving during it); and the time from a request's "
               "arrival in the HTTP process to the engine reading it.\n")
        self.p(table(["engine", "c", "iterations", "steps: share x mean (tokens)",
                      "in steps", "between ms", "longest ms", "arrival to engine ms", "p90"],
                     rows))

    def w3_server_processes(self, targets: list) -> None:
        """Per server level: the intake histogram's mean, the GPU's busy share (NVML), and
        each server process's CPU (bench/proc_cpu.py), where the run recorded them."""
        rows = []
        for t, _ in targets:
            for lv in sorted(t.get("levels", []), key=lambda lv: lv["concurrency"]):
                if not lv.get("server_cpu"):
                    continue
                procs = "; ".join(
                    f"{r['name']} {r['share']}" + (" (" + ", ".join(
                        f"{x['name']} {x['share']}" for x in r["threads"]) + ")"
                        if len(r["threads"]) > 1 else "")
                    for r in lv["server_cpu"] if r["share"] >= 0.05)
                rows.append([t["label"], lv["concurrency"], lv.get("server_intake_ms_mean", "-"),
                             lv.get("gpu_util_mean", "-"), procs])
        if not rows:
            return
        self.p("\nThe server's processes during each level: intake (from the HTTP request "
               "reaching the app to its submission to the engine: parsing, validation, "
               "tokenization), the GPU's busy share as NVML reports it, and each process's "
               "CPU as a share of one core, with its threads (`root:` is the process the "
               "benchmark started, the first HTTP frontend; `mv-receiver` its thread that "
               "reads the engine's outputs; `minivllm-engine` the engine process). A share "
               "near 1.0 marks the part that limits the server.\n")
        self.p(table(["engine", "c", "intake ms", "GPU busy %", "CPU per process (threads)"],
                     rows))

    def w3_plots(self, run: Path, series: dict, cap: str) -> None:
        plt = self.plot.plt
        slug = _slug(rel(run, self.base))
        names = []

        def axes_common(ax, ylabel, title, log_y=False):
            cs = sorted({lv["concurrency"] for v in series.values() for lv in v})
            ax.set_xscale("log", base=2)
            ax.set_xticks(cs, [str(c) for c in cs])
            ax.set_xlabel("concurrent streaming clients")
            ax.set_ylabel(ylabel)
            if log_y:
                ax.set_yscale("log")
            ax.set_title(title, fontsize=9)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)

        fig, ax = plt.subplots(figsize=(7, 4.4))
        for label, lvs in series.items():
            ax.plot([lv["concurrency"] for lv in lvs], [lv["output_tok_per_s"] for lv in lvs],
                    "o-", label=label)
        axes_common(ax, "output tokens/s", "W3 throughput vs concurrency")
        names.append(("throughput", self.plot.save(fig, f"w3_{slug}_throughput.png", cap)))

        for metric, title in (("ttft", "time to first token"), ("itl", "inter-token latency")):
            fig, ax = plt.subplots(figsize=(7, 4.4))
            for i, (label, lvs) in enumerate(series.items()):
                color = f"C{i}"
                for q, style in (("p50", "o-"), ("p99", "^--")):
                    pts = [(lv["concurrency"], lv.get(f"{metric}_ms_{q}")) for lv in lvs
                           if lv.get(f"{metric}_ms_{q}")]
                    if pts:
                        ax.plot(*zip(*pts), style, color=color, label=f"{label} {q}")
            axes_common(ax, "ms (log scale)", f"W3 {title} p50 / p99 vs concurrency",
                        log_y=True)
            names.append((metric, self.plot.save(fig, f"w3_{slug}_{metric}.png", cap)))

        mem = {k: [(lv["concurrency"], lv["peak_gpu_mem_gib"]) for lv in v
                   if lv.get("peak_gpu_mem_gib") is not None] for k, v in series.items()}
        mem = {k: v for k, v in mem.items() if v}
        if mem:
            fig, ax = plt.subplots(figsize=(7, 4.4))
            for label, pts in mem.items():
                ax.plot(*zip(*pts), "o-", label=label)
            axes_common(ax, "peak GPU memory used (GiB, whole GPU)", "W3 peak GPU memory")
            names.append(("peak GPU memory", self.plot.save(fig, f"w3_{slug}_gpu_mem.png", cap)))
        else:
            self.p("\nPeak GPU memory: " + NOT_MEASURED + " in this run (no GPU or no "
                   "nvidia-ml-py).")
        self.p("")
        for what, name in names:
            self.p(f"![W3 {what}]({name})")
        self.p(f"\n{cap}")

    def w3_ratios(self, targets: list, env: dict, headline: bool = True,
                  run: Path | None = None) -> None:
        """headline=False: a vs-vLLM run (its own headline rows, per model)."""
        by = {t["label"]: {lv["concurrency"]: lv for lv in t.get("levels", [])
                           if lv.get("output_tok_per_s")} for t, _ in targets}
        self.w3_variants_vs_offline(by)
        server = by.get("minivllm")
        if not server:
            return
        variants = sorted(k for k in by if is_server_variant(k))
        # A server run with a generation_config.json (bench/w3_gpu.py's -genconfig labels) is
        # paired with minivllm's of the same setting in bench/vs_vllm.py's table, not here.
        peers = [k for k in by if k != "minivllm" and k not in variants
                 and not k.endswith("-genconfig")]
        cs = sorted(server)
        rows = []
        for c in cs:
            row = [c, server[c]["output_tok_per_s"]]
            for k in peers:
                lv = by[k].get(c)
                row.append(ratio(server[c]["output_tok_per_s"], lv and lv["output_tok_per_s"]))
            rows.append(row)
        if peers:
            self.p("\nminivllm's server throughput as a multiple of each peer's at the same "
                   "concurrency (`minivllm-offline` is minivllm's own engine without HTTP):\n")
            self.p(table(["c", "minivllm tok/s"] + [f"÷ {k}" for k in peers], rows))
        off = by.get("minivllm-offline", {})
        c = W3_TARGET_CONCURRENCY
        head = {"env": env, "server": server.get(c, {}).get("output_tok_per_s"),
                "variants": {k: by[k][c]["output_tok_per_s"] for k in variants if c in by[k]},
                "offline": off.get(c, {}).get("output_tok_per_s"), "peers": {},
                "best_server": max(lv["output_tok_per_s"] for lv in server.values()),
                "best_server_c": max(server.values(),
                                     key=lambda lv: lv["output_tok_per_s"])["concurrency"]}
        for k in peers:
            if k == "minivllm-offline":
                continue
            # At the target concurrency, else at the largest one both measured.
            common = [x for x in by[k] if x in server]
            at = c if c in common else (max(common) if common else None)
            if at is not None:
                head["peers"][k] = (at, by[k][at]["output_tok_per_s"],
                                    server[at]["output_tok_per_s"])
        if head["server"] and head["offline"]:
            share = head["server"] / head["offline"]
            verdict = "within 20%" if share >= 0.8 else "NOT within 20%"
            self.p(f"\nServer vs offline engine at concurrency {c}: {fmt(head['server'])} vs "
                   f"{fmt(head['offline'])} tok/s = {100 * share:.0f}% ({verdict}; target: "
                   f"within 20%).")
        elif env.get("gpu"):
            where = f" in `{rel(run, self.base)}`" if run is not None else ""
            self.not_measured(f"server vs offline engine at concurrency {c}{where}",
                              "the run lacks one of the two")
        if not headline:
            return
        extra = extra_engine_flags(targets)
        if extra:
            self.p(f"\nThis run's engine had non-default flags ({' '.join(extra)}): it is not "
                   "used for the headline.")
        elif env.get("gpu") and "W3" not in self.headline:
            self.headline["W3"] = head
        elif env.get("gpu"):
            # A peer the newest run lacks comes from the newest run that has it, with that
            # run's own minivllm number, so each ratio stays within one run.
            for k, v in head["peers"].items():
                if k not in self.headline["W3"]["peers"]:
                    self.headline["W3"]["peers"][k] = v
                    self.headline["W3"].setdefault("peers_commit", {})[k] = (
                        env.get("git_commit", "?"))

    def w3_variants_vs_offline(self, by: dict) -> None:
        """Variants of minivllm's server in the run (several HTTP processes, label
        minivllm-apiN; other labels minivllm-*, e.g. an engine switch) against the offline
        engine of the same run, at the target concurrency."""
        c = W3_TARGET_CONCURRENCY
        offline = by.get("minivllm-offline", {}).get(c, {}).get("output_tok_per_s")
        for k in sorted(x for x in by if is_server_variant(x)):
            got = by[k].get(c, {}).get("output_tok_per_s")
            if got and offline:
                self.p(f"\n`{k}` ({variant_title(k)}) vs offline engine at concurrency {c}: "
                       f"{fmt(got)} vs {fmt(offline)} tok/s = {100 * got / offline:.0f}%.")

    def w3_ramp(self, rs: list[Result], targets: list) -> None:
        ramp = next((r.data["ramp"] for r in rs if r.data.get("ramp")), None)
        if ramp is None:
            ok = [lv["concurrency"] for t, _ in targets if t["label"] == "minivllm"
                  for lv in t.get("levels", []) if lv.get("failures") == 0]
            if ok:
                self.p(f"\nLargest concurrency held without a failed request: no ramp in this "
                       f"run; the sweep's largest level without a failure was {max(ok)} "
                       f"(a lower bound).")
            return
        mx = ramp.get("max_concurrency_without_failure")
        if ramp.get("first_failure") is not None:
            tail = f"the first failure came at concurrency {ramp['first_failure']}"
        elif ramp.get("reached_cap"):
            tail = f"no request failed up to the cap of {ramp.get('cap')}: {mx} is a lower bound"
        else:
            tail = f"the ramp stopped early ({ramp.get('stopped_by')}): {mx} is a lower bound"
        self.p(f"\n**Largest concurrency held with no failed request: {fmt(mx)}** "
               f"(memory budget `{ramp.get('memory_budget')}`; {tail}). Ramp levels (one round "
               f"each): " + ", ".join(
                   f"{lv['concurrency']}: {fmt(lv.get('output_tok_per_s'))} tok/s, "
                   f"{lv.get('failures')} failed" for lv in ramp.get("levels", []))
               + f". Server flags: `{ramp.get('server_args', '')}`.")
        if "W3" in self.headline and mx is not None:
            # Runs come newest first: the headline keeps the newest run's ramp, and the
            # largest concurrency any run held, with where it was measured.
            h = self.headline["W3"]
            if "max_concurrency" not in h:
                h["max_concurrency"], h["max_concurrency_how"] = mx, tail
            best = h.get("max_concurrency_any")
            if best is None or mx > best[0]:
                h["max_concurrency_any"] = (mx, rel(rs[0].path.parent, self.base))

    # -- minivllm vs vLLM --

    def newest_vs_vllm(self) -> list[Result]:
        """The newest vs_vllm runs of each model and variant (GPU runs first): a run of only
        quantized engines ("W1 fp8" rows) does not stand in for the unquantized one, and an
        older run stays while it has a workload the newer ones lack (each run's cells were
        measured together, so runs are shown whole, not merged)."""
        def variant(r: Result) -> str:
            if any((r.data.get("offline") or {}).values()):
                return ""
            return ",".join(sorted(r.data.get("offline_quantized") or {}))

        runs = sorted(self.res.vs_vllm, key=lambda r: (bool(r.env.get("gpu")), r.date,
                                                       str(r.path)))
        # Keys in the order of their oldest run, each key's runs newest first.
        shown: dict[tuple[str, str], list[Result]] = {}
        for r in runs:
            shown.setdefault((r.data.get("model", "?"), variant(r)), [])
        covered: dict[tuple[str, str], set] = {}
        for r in reversed(runs):
            key = (r.data.get("model", "?"), variant(r))
            cells = {row.get("workload") for row in r.data.get("rows", [])}
            if key in covered and cells <= covered[key]:
                continue
            covered.setdefault(key, set()).update(cells)
            shown[key].append(r)
        return [r for group in shown.values() for r in group]

    def vs_vllm(self) -> None:
        self.h(2, "minivllm against vLLM (each workload's two engines in one device call)")
        runs = self.newest_vs_vllm()
        if not runs:
            self.not_measured("minivllm vs vLLM", "no bench.vs_vllm result (run "
                              "`bash bench/run_vs_vllm.sh MODEL` on a GPU with the vLLM bundle)")
            return
        self.p("W1 output tok/s (256 requests, in/out uniform in [100, 1024]); W2 output tok/s "
               "(batch 1, 128 in / 256 out); W5 prompt tok/s (32 x 4096 tokens, 1 out); W6 "
               "output tok/s (64 x 8192 in, 256 out each); W3: the HTTP servers with the "
               "same client, 128 in / 128 out, streamed; D<B>: ms per decode step at batch "
               "B with 1,024-token prompts (a 257-token run's time less a 1-token run's, "
               "over 256 steps). Ratio: minivllm ÷ vLLM for throughput, vLLM ÷ minivllm "
               "for latency and step times (above 1: minivllm better). Offline rows are "
               "greedy; \"W1 sampled\", \"W1 top_p\" and so on: the same workload under "
               "that sampling setting (bench/vs_vllm.py's SAMPLING, both engines alike); "
               "\"W3 genconfig\": both servers reading the model's generation_config.json "
               "(bench/w3_gpu.py --generation-config-json).\n")
        self.p("Floor: the workload's ideal on the H200 (800 TFLOP/s bf16, 4.28 TB/s HBM) "
               "for bf16 weights and KV cache, prefill then decode, each step bound by its "
               "FLOPs or its bytes ([bench/roofline.py](../../roofline.py)); offline rows of "
               "quantized runs, of sampling settings other than greedy and of quantized "
               "checkpoints get none.\n")
        for r in runs:
            self.h(3, f"{r.data.get('model')}: `{rel(r.run, self.base)}`")
            # A smoke run (CPU) stands a tiny model in for the named one: no floor.
            cfg = roofline.load_config(r.data.get("model", "")) if r.env.get("gpu") else None
            if cfg and "quantization_config" in cfg:  # a quantized checkpoint's config
                cfg = None
            rows = []
            for x in r.data.get("rows", []):
                floor, shares = "-", "-"
                if cfg and x["workload"] in roofline.WORKLOADS:  # plain bf16 offline rows
                    ideal = roofline.workload_floor(cfg, x["workload"])["ideal_value"]
                    floor = f"{ideal:,.0f}"
                    shares = " / ".join(f"{100 * v / ideal:.0f}%" if v else "-"
                                        for v in (x.get("minivllm"), x.get("vllm")))
                rows.append([x["workload"], x.get("label") or x["metric"],
                             x.get("minivllm") or "-", x.get("vllm") or "-",
                             f"{x['ratio']:.2f}x" if x.get("ratio") else "-", floor, shares])
            self.p(table(["workload", "metric", "minivllm", "vLLM", "ratio", "floor",
                          "minivllm / vLLM % of floor"], rows))
            off = r.data.get("offline") or {}
            notes = []
            for k in ("minivllm", "vllm"):
                e = off.get(k) or {}
                if e:
                    notes.append(f"{k} {e.get('version', '?')}: start-up {e.get('startup_s')} s, "
                                 f"settings {json.dumps(e.get('settings'))}"
                                 + (f", failed: {e['errors']}" if e.get("errors") else ""))
                else:
                    notes.append(f"{k}: offline {NOT_MEASURED}")
            for k, w in (r.data.get("w3") or {}).items():
                if w.get("launch_cmd"):
                    notes.append(f"{k} server: `{w['launch_cmd']}`")
            self.p("\n" + "; ".join(notes) + ".")
            self.p(f"\n{provenance(r.env, r.data.get('model'), self.src(r))}")

    # -- one-engine offline runs, kernel tuning, profiles --

    def offline_runs(self) -> None:
        """Folders of offline runs of one engine each (A/Bs of minivllm variants); the
        vs-vLLM folders' inputs are shown merged above."""
        merged = {r.run for r in self.res.vs_vllm}
        runs = {d: rs for d, rs in self.res.offline.items() if d not in merged}
        if not runs:
            return
        self.h(2, "Offline A/B runs (one engine per process, same device call)")
        for d, rs in sorted(runs.items()):
            self.h(3, f"`{rel(d, self.base)}`")
            names = sorted({w for r in rs for w in r.data.get("best", {})})
            rows = [[r.path.stem, r.data.get("model", "?")]
                    + [fmt((r.data.get("best", {}).get(w) or {}).get("value"), 0) for w in names]
                    for r in sorted(rs, key=lambda r: r.path.name)]
            self.p(table(["file", "model"] + [f"{w} ({'prompt' if w == 'W5' else 'output'} "
                                              "tok/s)" for w in names], rows))
            self.p(f"\n{provenance(rs[0].env, None, rel(d, self.base))}")

    def tuning_and_profiles(self) -> None:
        if not (self.res.tuning or self.res.profiles or self.res.host_cpu):
            return
        self.h(2, "Prefill attention tiles and step profiles")
        for r in self.res.tuning:
            cache = r.data.get("kv_cache_dtype", "bfloat16")
            cache = "" if cache == "bfloat16" else f", {cache} KV cache"
            self.p(f"Paged prefill attention (bf16{cache}), TFLOP/s: the default tile config, "
                   "the best of the sweep, and torch SDPA on contiguous K/V (fresh prompts "
                   "only).\n")
            rows = [[x["model"], x["shape"], fmt(x["default_TFLOPs"], 0), fmt(x["best_TFLOPs"], 0),
                     " ".join(f"{k}={v}" for k, v in x["best"].items()),
                     fmt(x.get("sdpa_flash"), 0) if isinstance(x.get("sdpa_flash"), float) else "-",
                     fmt(x.get("sdpa_cudnn"), 0) if isinstance(x.get("sdpa_cudnn"), float) else "-"]
                    for x in r.data.get("summary", [])]
            self.p(table(["model", "shape", "default", "best", "best config", "SDPA flash",
                          "SDPA cuDNN"], rows))
            self.p(f"\n{provenance(r.env, None, self.src(r))}")
        for r in self.res.profiles:
            d = r.data
            quant = f" ({d['quantization']})" if d.get("quantization") else ""
            self.p(f"\n{d.get('model')}{quant} {d.get('workload')} x{d.get('requests')}: wall "
                   f"{d.get('wall_ms')} ms, kernels {d.get('kernel_ms')} ms "
                   f"({100 * d.get('gpu_busy', 0):.0f}% busy).\n")
            self.p(table(["kernel", "share", "ms", "calls", "us per call"],
                         [[x["kernel"][:70], f"{100 * x['share']:.1f}%", x["ms"], x["calls"],
                           x["us_per_call"]] for x in d.get("top_kernels", [])[:10]]))
            self.p(f"\n{provenance(r.env, d.get('model'), self.src(r))}")
        for r in self.res.host_cpu:
            d = r.data
            self.p(f"\nThe engine loop's host time per step on the CPU, device work excluded "
                   f"(bench.engine_host_cpu): {d.get('requests')} requests of "
                   f"{d.get('prompt_tokens')} + {d.get('output_tokens')} tokens.\n")
            self.p(table(["sampling", "median ms/step", "mean ms/step", "sampler us/step"],
                         [[name, x["host_ms_per_step_median"], x["host_ms_per_step_mean"],
                           ", ".join(f"{k} {v}" for k, v in x["sampler_us_per_step"].items())]
                          for name, x in d.get("settings", {}).items()]))
            self.p(f"\n{provenance(r.env, None, self.src(r))}")

    def decode_steps(self) -> None:
        """bench.diagnostics.decode_steps: one table per folder, a row per file."""
        if not self.res.decode_steps:
            return
        self.h(2, "Decode steps by batch size (ms per step)")
        for folder, runs in sorted(self.res.decode_steps.items()):
            runs = sorted(runs, key=lambda r: r.path.name)
            points = sorted({(x["batch"], x["context"]) for r in runs
                             for x in r.data.get("rows", [])})
            d = runs[0].data
            quant = f", {d['quantization']}" if d.get("quantization") else ""
            self.h(3, f"`{rel(folder, self.base)}`: {d.get('model')}{quant}")
            rows = []
            for r in runs:
                ms = {(x["batch"], x["context"]): x["ms_per_step"] for x in r.data["rows"]}
                rows.append([f"`{r.path.name}`", (r.env.get("git_commit") or "")[:7]]
                            + [fmt(ms.get(pt), 2) for pt in points])
            self.p(table(["file", "commit"] + [f"{b} x {c}" for b, c in points], rows))
            self.p(f"\n{provenance(runs[0].env, d.get('model'), self.src(runs[0]))}")

    def kv_cache_fp8(self) -> None:
        """bench.kv_cache_fp8: capacity and decode steps, the e4m3 cache against the model
        dtype's, a table per file."""
        if not self.res.kv_cache_fp8:
            return
        self.h(2, "FP8 KV cache: capacity and decode steps (ms per step)")
        for r in sorted(self.res.kv_cache_fp8, key=lambda r: str(r.path)):
            by = {(x["kv_cache_dtype"], x["batch"], x["context"]): x for x in r.data["rows"]}
            points = sorted({(b, c) for _, b, c in by})
            rows = []
            for b, c in points:
                auto, fp8 = by.get(("auto", b, c)), by.get(("fp8", b, c))
                ratio = (fp8["ms_per_step"] / auto["ms_per_step"]) if auto and fp8 else None
                rows.append([f"{b} x {c}", fmt(auto and auto["ms_per_step"], 2),
                             fmt(fp8 and fp8["ms_per_step"], 2),
                             f"{ratio:.2f}x" if ratio else "-"])
            tokens = {k[0]: x["kv_cache_tokens"] for k, x in by.items()}
            self.h(3, f"`{rel(r.path, self.base)}`: {r.data.get('model')}, KV cache "
                      f"{fmt(tokens.get('auto'), 0)} tokens (model dtype) against "
                      f"{fmt(tokens.get('fp8'), 0)} (e4m3)")
            self.p(table(["batch x context", "model dtype", "e4m3", "e4m3 / model dtype"], rows))
            self.p(f"\n{provenance(r.env, r.data.get('model'), self.src(r))}")

    def decode_splits(self) -> None:
        """bench.diagnostics.decode_splits: a decode-attention layer by split count (us);
        the engine's plan marked with *."""
        if not self.res.decode_splits:
            return
        self.h(2, "Decode attention by KV split count (one layer, us)")
        self.p("\n* marks the split count the engine picked at the file's commit.")
        for r in sorted(self.res.decode_splits, key=lambda r: str(r.path)):
            splits = sorted({x["splits"] for x in r.data["rows"]})
            cells: dict = {}
            for x in r.data["rows"]:
                key = (x["batch"], x["context"], x["cache"])
                mark = "*" if x.get("plan") or x.get("default") else ""
                if mark or (key, x["splits"]) not in cells:
                    cells[(key, x["splits"])] = f"{fmt(x['us'])}{mark}"
            keys = sorted({k for k, _ in cells})
            rows = [[f"{b} x {c}", cache] + [cells.get((k, n), "") for n in splits]
                    for k in keys for b, c, cache in [k]]
            self.h(3, f"`{rel(r.path, self.base)}`")
            self.p(table(["batch x context", "cache"] + [f"{n} splits" for n in splits], rows))
            self.p(f"\n{provenance(r.env, 'llama-3.1-8b heads', self.src(r))}")

    # -- W7 --

    def w7(self) -> None:
        if not self.res.w7:
            return
        self.h(2, "W7: speculative decoding (SmolLM2-135M, real weights)")
        for r in sorted(self.res.w7, key=lambda r: r.path.name):
            d = r.data
            cfgs = d.get("speculative_configs") or {"ngram": d.get("speculative_config", {})}
            ks = sorted({c.get("num_speculative_tokens") for c in cfgs.values()})
            temp = d.get("temperature", 0.0)
            self.h(3, f"`{rel(r.path, self.base)}`: k={', '.join(map(str, ks))}, "
                      f"{'greedy' if not temp else f'temperature {temp}'}")
            self.p(table(["prompts", "mode", "method", "plain tok/s", "speculative tok/s",
                          "speed-up", "accepted", "tokens per verification", "identical"],
                         [[x["prompts"], x["mode"], x.get("method", "ngram"),
                           x["plain_tok_per_s"], x.get("spec_tok_per_s", x.get("ngram_tok_per_s")),
                           f"{x['speedup']:.2f}x", f"{x['acceptance_rate']:.0%}",
                           x["tokens_per_verified_step"],
                           "n/a (sampled)" if x["identical"] is None else x["identical"]]
                          for x in d.get("rows", [])]))
            self.p(f"\n{provenance(r.env, d.get('model', 'SmolLM2-135M-Instruct'), self.src(r))}")

    # -- quantization accuracy --

    def quant_accuracy(self) -> None:
        if not self.res.quant:
            return
        self.h(2, "Quantization accuracy (SmolLM2-135M, real weights)")
        for r in sorted(self.res.quant, key=lambda r: r.path.name):
            d = r.data
            self.h(3, f"`{rel(r.path, self.base)}`: perplexity over {d['rows'][0]['tokens_scored']}"
                      f" tokens of `{d.get('text')}`, agreement over {d.get('prompts')} prompts x "
                      f"{d.get('max_tokens')} greedy tokens")
            self.p(table(["method", "perplexity", "vs none", "tokens before the first divergence",
                          "identical outputs", "weight bytes"],
                         [[x["method"], x["perplexity"], f"{x['perplexity_vs_none'] - 1:+.1%}",
                           f"{x['agreement_before_divergence']:.0%}", x["identical_outputs"],
                           f"{x['weight_bytes'] / 1e6:,.0f} MB"] for x in d.get("rows", [])]))
            self.p(f"\n{provenance(r.env, d.get('model', 'SmolLM2-135M-Instruct'), self.src(r))}")

    # -- W4 --

    def w4(self) -> None:
        self.h(2, "W4: CPU (SmolLM2-135M fp32, 8 requests x 64 tokens)")
        if not self.res.w4:
            self.not_measured("W4")
            return
        r = max(self.res.w4, key=lambda r: r.date)
        self.p(table(["engine", "output tok/s", "seconds", "vs HF one at a time"],
                     [[x["engine"], x.get("output_tok_per_s"), x.get("seconds"),
                       f"{x.get('speedup_vs_hf_one_at_a_time', 0):.2f}x"]
                      for x in r.data.get("rows", [])]))
        self.p(f"\n{provenance(r.env, model_of(r), self.src(r))}")

    # -- headline --

    def headline_table(self) -> list[str]:
        rows = []
        w1, w2, w3 = (self.headline.get(k) for k in ("W1", "W2", "W3"))
        for name, h in (("W1 offline, output tok/s", w1), ("W2 batch 1, tok/s", w2)):
            if not h or not h.get("ours"):
                rows.append([name, "minivllm", NOT_MEASURED, "-"])
                continue
            label, v = h["ours"]
            rows.append([name, label, fmt(v), "-"])
            for peer in h["expected"] + [k for k in h["peers"] if k not in h["expected"]]:
                pv = h["peers"].get(peer)
                mine = v
                if peer in h.get("ours_on_slice", {}):
                    work, mine = h["ours_on_slice"][peer]
                    rows.append([name, f"minivllm ({work})", fmt(mine), "-"])
                rows.append([name, peer, fmt(pv) if pv else NOT_MEASURED, ratio(mine, pv)])
        c = W3_TARGET_CONCURRENCY
        name = f"W3 serving (GPU), out tok/s at c={c}"
        if not w3 or not w3.get("server"):
            rows.append([name, "minivllm server", NOT_MEASURED, "-"])
        else:
            rows.append([name, "minivllm server", fmt(w3["server"]), "-"])
            off = w3.get("offline")
            rows.append([name, "minivllm offline engine (same requests)",
                         fmt(off) if off else NOT_MEASURED,
                         ratio(w3["server"], off) + (" (server ÷ offline; target >= 0.80x)"
                                                     if off else "")])
            for k, v in w3.get("variants", {}).items():
                rows.append([name, f"minivllm server ({variant_title(k)})",
                             fmt(v), ratio(v, off) + " (÷ offline)" if off else "-"])
            for peer in ["transformers-cb", "transformers"] + [
                    k for k in w3["peers"] if k not in ("transformers-cb", "transformers")]:
                title = {"transformers-cb": "transformers serve --continuous-batching",
                         "transformers": "transformers serve"}.get(peer, peer)
                if peer not in w3["peers"]:
                    rows.append([name, title, NOT_MEASURED, "-"])
                    continue
                at, pv, sv = w3["peers"][peer]
                where = "" if at == c else f" (at c={at}, where both were measured)"
                if peer in w3.get("peers_commit", {}):
                    where += (f" (another run: ratio to that run's server, commit "
                              f"{w3['peers_commit'][peer]}: {fmt(sv)} tok/s)")
                rows.append([name, title + where, fmt(pv), ratio(sv, pv)])
        vs = self.newest_vs_vllm()
        if not vs:
            rows.append(["vs vLLM", "vLLM", NOT_MEASURED + " (no committed result yet)", "-"])
        named: set[str] = set()
        half: dict[str, tuple[dict, str | None]] = {}  # cells a run measured one engine of

        def cell(name: str, x: dict, version: str | None) -> None:
            rows.append([name, "minivllm", fmt(x.get("minivllm")) if x.get("minivllm")
                         else NOT_MEASURED, "-"])
            rows.append([name, f"vLLM {version or ''}".strip(),
                         fmt(x.get("vllm")) if x.get("vllm") else NOT_MEASURED,
                         f"{x['ratio']:.2f}x" if x.get("ratio") else "-"])

        for r in vs:  # each key's newest run first: it gives a cell two runs have
            version = ((r.data.get("offline") or {}).get("vllm") or {}).get("version")
            for x in r.data.get("rows", []):
                if x["metric"] not in ("output_tok_per_s", "prompt_tok_per_s"):
                    continue
                gpu = r.env.get("gpu", "")
                on = "" if not gpu or "H200" in gpu else f" ({gpu.replace('NVIDIA ', '')})"
                name = (f"{r.data.get('model')} {x['workload']}, "
                        f"{x['metric'].replace('_per_s', '/s').replace('_', ' ')}{on}")
                if name in named:
                    continue
                if not (x.get("minivllm") and x.get("vllm")):
                    half.setdefault(name, (x, version))  # an older run may have both
                    continue
                named.add(name)
                cell(name, x, version)
        for name, (x, version) in half.items():
            if name not in named:
                cell(name, x, version)
        lines = [table(["workload", "engine", "value", "minivllm ÷ engine"], rows)]
        envs = [h["env"] for h in (w1, w2, w3) if h]
        if envs:
            lines.append("\n" + "; ".join(sorted({f"{machine(e)}, {e.get('date', '?')[:10]}, "
                                                   f"commit {e.get('git_commit', '?')}"
                                                   for e in envs})))
        if vs:  # each vs-vLLM run's own provenance: the runs are of different commits
            lines.append("\nvs vLLM: " + "; ".join(
                " ".join([r.data.get("model", "?"), *sorted(r.data.get("offline_quantized") or {})])
                + f" ({machine(r.env)}, {r.env.get('date', '?')[:10]}, commit "
                f"{str(r.env.get('git_commit', '?'))[:7]})" for r in vs) + ".")
        if w3 and w3.get("max_concurrency") is not None:
            any_run = w3.get("max_concurrency_any")
            more = (f"; {any_run[0]} in `{any_run[1]}`" if any_run
                    and any_run[0] > w3["max_concurrency"] else "")
            lines.append(f"\nW3: largest concurrency with no failed request: "
                         f"{w3['max_concurrency']} in the newest run with a ramp "
                         f"({w3['max_concurrency_how']})"
                         f"{more}; best server throughput "
                         f"{fmt(w3['best_server'])} tok/s at c={w3['best_server_c']}.")
        return lines

    # -- all --

    def build(self) -> str:
        self.correctness()
        self.w1()
        self.w2()
        self.sweep()
        self.w3()
        self.vs_vllm()
        self.offline_runs()
        self.tuning_and_profiles()
        self.decode_steps()
        self.kv_cache_fp8()
        self.decode_splits()
        self.w7()
        self.quant_accuracy()
        self.w4()
        body = self.md
        head = ["# minivllm benchmark report", "",
                "Generated by `python -m bench report` from the JSON under "
                + ", ".join(f"`{rel(Path(d), self.base)}`" for d in self.dirs)
                + " alone: rerun it after adding results. Nothing here is estimated: a missing "
                  "measurement says " + f'"{NOT_MEASURED}".', "",
                "## Headline", ""]
        head += self.headline_table()
        head += ["", "## Not measured", ""]
        head += [f"- {m}" for m in self.missing] or ["- nothing"]
        tail = ["", "## Files", ""]
        tail += [f"- `{rel(p, self.base)}` (not a known result format)" for p in
                 self.res.ignored]
        tail += ["- plots: " + ", ".join(f"`{p.name}`" for p in self.plot.files)]
        return "\n".join(head + body + tail) + "\n"


def render(dirs: list[Path], out: Path, base: Path | None = None) -> Path:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.png"):
        old.unlink()
    res = load([Path(d) for d in dirs], skip=out)
    rep = Report(res, out, base or Path.cwd(), dirs)
    md = rep.build()
    path = out / "report.md"
    path.write_text(md)
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench report", description=__doc__.split(
        "\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--results", nargs="+", default=[str(RESULTS_DIR)],
                    help="Result folders or files (default bench/results, recursively).")
    ap.add_argument("--out", default=str(DEFAULT_OUT),
                    help="Folder for report.md and the PNGs (default bench/results/report).")
    args = ap.parse_args(argv)
    base = BENCH_DIR.parent if str(Path.cwd().resolve()).startswith(
        str(BENCH_DIR.parent.resolve())) else Path.cwd()
    path = render([Path(d) for d in args.results], Path(args.out), base)
    print(f"wrote {path} ({len(list(Path(args.out).glob('*.png')))} plots)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
