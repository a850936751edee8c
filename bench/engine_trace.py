"""Summaries of the engine process's step trace (minivllm.engine.step_trace) over a time
window, e.g. one W3 level: how many steps of each kind (decode graph, pipelined decode,
mixed-step graph, eager) it ran and how long they took, how long the loop spent between
steps (reading commands before, sending outputs after), and how long added requests took
from the frontend's arrival stamp to the engine reading them.

    python -m bench.engine_trace TRACE.json [--from T0 --to T1]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, int(round((len(v) - 1) * q / 100)))]


def _ms(x: float | None) -> float | None:
    return None if x is None else round(1000 * x, 3)


def load(path: str | Path) -> dict:
    return json.loads(Path(path).read_text())


def summarize(trace: dict, t0: float | None = None, t1: float | None = None) -> dict:
    """The trace's iterations that woke within [t0, t1] (all if not given)."""
    f = {name: i for i, name in enumerate(trace["step_fields"])}
    lo = float("-inf") if t0 is None else t0
    hi = float("inf") if t1 is None else t1
    steps = [s for s in trace["steps"] if lo <= s[f["woke"]] <= hi]
    out: dict = {"iterations": len(steps)}
    if not steps:
        return out
    span = (steps[-1][f["step_end"]] - steps[0][f["woke"]]) if t0 is None else (hi - lo)
    durations: dict[str, list[float]] = {}
    tokens: dict[str, list[int]] = {}
    seqs: dict[str, list[int]] = {}
    for s in steps:
        path = s[f["path"]] or "no_launch"
        durations.setdefault(path, []).append(s[f["step_end"]] - s[f["commands_read"]])
        tokens.setdefault(path, []).append(s[f["tokens"]])
        seqs.setdefault(path, []).append(s[f["seqs"]])
    out["by_path"] = {
        path: {"count": len(d), "share": round(len(d) / len(steps), 3),
               "mean_ms": _ms(sum(d) / len(d)), "p50_ms": _ms(_pct(d, 50)),
               "p90_ms": _ms(_pct(d, 90)), "max_ms": _ms(max(d)),
               "tokens_mean": round(sum(tokens[path]) / len(d), 1),
               "seqs_mean": round(sum(seqs[path]) / len(d), 1)}
        for path, d in sorted(durations.items())}
    in_step = sum(s[f["step_end"]] - s[f["commands_read"]] for s in steps)
    reading = sum(s[f["commands_read"]] - s[f["woke"]] for s in steps)
    between = [b[f["woke"]] - a[f["step_end"]] for a, b in zip(steps, steps[1:])]
    out.update({
        "window_s": round(span, 3),
        "in_step_share": round(in_step / span, 3) if span > 0 else None,
        "reading_commands_share": round(reading / span, 3) if span > 0 else None,
        # After a step: sending the outputs, then (if idle) waiting for a command.
        "between_steps_ms_mean": _ms(sum(between) / len(between)) if between else None,
        "between_steps_ms_p90": _ms(_pct(between, 90)),
        "between_steps_ms_max": _ms(max(between)) if between else None,
        # The longest loop iteration, wake to wake: a stall of any kind (a slow step, a
        # blocked send to a frontend) delays every request that arrives during it.
        "longest_iteration_ms": _ms(max((b[f["woke"]] - a[f["woke"]]
                                         for a, b in zip(steps, steps[1:])), default=None)),
        "commands_per_iteration": round(sum(s[f["commands"]] for s in steps) / len(steps), 2),
    })
    a = {name: i for i, name in enumerate(trace.get("add_fields", ()))}
    lags = [x[a["since_arrival"]] for x in trace.get("adds", [])
            if lo <= x[a["received"]] <= hi] if a else []
    if lags:
        out["adds"] = len(lags)
        out["add_arrival_to_engine_ms_mean"] = _ms(sum(lags) / len(lags))
        out["add_arrival_to_engine_ms_p90"] = _ms(_pct(lags, 90))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--from", dest="t0", type=float, default=None)
    ap.add_argument("--to", dest="t1", type=float, default=None)
    args = ap.parse_args(argv)
    print(json.dumps(summarize(load(args.trace), args.t0, args.t1), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
