"""Prometheus metrics in the text exposition format (0.0.4), written by hand.

Names follow vLLM's with a `minivllm:` prefix. Histograms and the success counter are fed
by the engine thread (EngineMetrics implements the AsyncLLMEngine's StatLogger hooks);
gauges and token counters are read at scrape time from the engine's published snapshot.
With several API server processes (`--api-servers N`) each writes its request metrics to
its own row of one shared array and a scrape, whichever process answers it, sums the rows:
counters never go back between scrapes (vLLM's multiprocess mode does the same with files).
"""

from __future__ import annotations

import bisect
import math
import threading

import numpy as np

from ..engine.output_codec import DecodedOutput
from ..outputs import RequestOutput

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15,
               0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                   50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{_escape(str(v))}"' for k, v in labels.items()) + "}"


def _num(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


class Histogram:
    """Its numbers live in a row of the metrics' store: a count per bucket (not
    cumulative), then the count, then the sum (`size` values from `offset`)."""

    def __init__(self, name: str, help_text: str, buckets: tuple[float, ...],
                 offset: int) -> None:
        self.name = name
        self.help = help_text
        self.buckets = tuple(sorted(buckets))
        self.offset = offset
        self.size = len(self.buckets) + 2

    def observe(self, row: memoryview, value: float) -> None:
        if value != value:  # NaN
            return
        i = bisect.bisect_left(self.buckets, value)  # the first bound >= value
        if i < len(self.buckets):
            row[self.offset + i] += 1
        row[self.offset + self.size - 2] += 1
        row[self.offset + self.size - 1] += value

    def render(self, labels: dict[str, str], row: np.ndarray) -> list[str]:
        values = row[self.offset:self.offset + self.size].tolist()
        counts, count, total = values[:-2], values[-2], values[-1]
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        cumulative = 0.0
        for bound, c in zip(self.buckets, counts):
            cumulative += c
            lines.append(f"{self.name}_bucket{_labels({**labels, 'le': _num(bound)})} "
                         f"{cumulative}")
        lines.append(f"{self.name}_bucket{_labels({**labels, 'le': '+Inf'})} {float(count)}")
        lines.append(f"{self.name}_sum{_labels(labels)} {_num(total)}")
        lines.append(f"{self.name}_count{_labels(labels)} {float(count)}")
        return lines


def _scalar(kind: str, name: str, help_text: str, samples: list[tuple[dict, float]]) -> list[str]:
    lines = [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
    lines += [f"{name}{_labels(lbl)} {_num(v)}" for lbl, v in samples]
    return lines


FINISH_REASONS = ("stop", "length", "abort")

# (attribute, name, help, buckets) of EngineMetrics' histograms, in their order in a row.
_HISTOGRAMS = (
    ("ttft", "minivllm:time_to_first_token_seconds",
     "Histogram of time to first token in seconds.", TTFT_BUCKETS),
    ("itl", "minivllm:inter_token_latency_seconds",
     "Histogram of inter-token latency in seconds.", ITL_BUCKETS),
    ("tpot", "minivllm:time_per_output_token_seconds",
     "Histogram of time per output token in seconds (mean over each finished request's "
     "decode phase).", ITL_BUCKETS),
    ("e2e", "minivllm:e2e_request_latency_seconds",
     "Histogram of end to end request latency in seconds.", LATENCY_BUCKETS),
    ("queue", "minivllm:request_queue_time_seconds",
     "Histogram of time spent waiting in the queue in seconds.", LATENCY_BUCKETS),
    # Before the engine's arrival stamp: the HTTP request's parsing and validation,
    # tokenization, and any wait for the frontend's event loop (TTFT starts after it).
    ("intake", "minivllm:request_intake_seconds",
     "Histogram of time from the HTTP request reaching the server's app to its submission "
     "to the engine in seconds.", TTFT_BUCKETS),
)
# A row: the finish-reason counters, then each histogram's values.
ROW_SIZE = len(FINISH_REASONS) + sum(len(h[3]) + 2 for h in _HISTOGRAMS)


def shared_metrics_store(processes: int):
    """A row of zeros per API server process in shared memory, for each process's
    EngineMetrics (passed to the processes it is shared with when they are spawned)."""
    from multiprocessing.sharedctypes import RawArray

    return RawArray("d", processes * ROW_SIZE)


class EngineMetrics:
    """Request-level metrics. on_step / on_abort run on the engine thread; render() on
    the server's event loop; a lock keeps a scrape consistent within a process. `store`
    (from shared_metrics_store) and `row`: this process's row of the shared store; without
    a store the metrics are this process's alone."""

    def __init__(self, model_name: str, store=None, row: int = 0) -> None:
        self.labels = {"model_name": model_name}
        self._lock = threading.Lock()
        if store is None:
            store = bytearray(8 * ROW_SIZE)  # one row, this process's alone
        self._rows = np.frombuffer(store, dtype=np.float64).reshape(-1, ROW_SIZE)
        # Written through a memoryview: an element update costs ~50 ns there, ~90 in numpy.
        self._row = memoryview(store).cast("B").cast("d")[row * ROW_SIZE:(row + 1) * ROW_SIZE]
        offset = len(FINISH_REASONS)
        for attr, name, help_text, buckets in _HISTOGRAMS:
            setattr(self, attr, Histogram(name, help_text, buckets, offset))
            offset += len(buckets) + 2
        # request id -> (tokens seen in sample 0, time of the last new token)
        self._progress: dict[str, tuple[int, float]] = {}

    def _finished(self, reason: str) -> None:
        self._row[FINISH_REASONS.index(reason)] += 1

    # ---- engine thread ----------------------------------------------------------------

    def on_step(self, now: float, outputs: list[RequestOutput]) -> None:
        with self._lock:
            for out in outputs:
                self._observe(now, out)

    def _observe(self, now: float, out: RequestOutput | DecodedOutput) -> None:
        rid = out.request_id
        if type(out) is DecodedOutput:  # from an engine process: don't build the output
            ntok = out.num_tokens
        else:
            ntok = len(out.outputs[0].token_ids) if out.outputs else 0
        prev = self._progress.get(rid)
        # Metrics only at a request's first token and at its end (a DecodedOutput builds
        # them on access).
        m = out.metrics if prev is None or out.finished else None
        if prev is None:
            if ntok == 0:
                return  # prompt chunk: nothing generated yet
            if m is not None:
                first = m.first_token_time or now
                self.ttft.observe(self._row, first - m.arrival_time)
                if m.first_scheduled_time is not None:
                    self.queue.observe(self._row, m.first_scheduled_time - m.arrival_time)
            prev = (ntok, now)
        elif ntok > prev[0]:
            self.itl.observe(self._row, (now - prev[1]) / (ntok - prev[0]))
            prev = (ntok, now)
        self._progress[rid] = prev
        if out.finished:
            self._progress.pop(rid, None)
            if m is not None:
                end = m.finished_time or now
                self.e2e.observe(self._row, end - m.arrival_time)
                if m.first_token_time is not None and ntok > 1:
                    self.tpot.observe(self._row, (end - m.first_token_time) / (ntok - 1))
            for o in out.outputs:
                self._finished(o.finish_reason or "abort")

    def observe_intake(self, seconds: float) -> None:
        """On the event loop, per submitted request."""
        with self._lock:
            self.intake.observe(self._row, seconds)

    def on_abort(self, request_id: str) -> None:
        with self._lock:
            self._progress.pop(request_id, None)
            self._finished("abort")

    # ---- scrape -----------------------------------------------------------------------

    def render(self, snapshot: dict) -> str:
        lbl = self.labels
        lines: list[str] = []
        lines += _scalar("gauge", "minivllm:num_requests_running",
                         "Number of requests in model execution batches.",
                         [(lbl, snapshot.get("num_requests_running", 0))])
        lines += _scalar("gauge", "minivllm:num_requests_waiting",
                         "Number of requests waiting to be processed.",
                         [(lbl, snapshot.get("num_requests_waiting", 0))])
        lines += _scalar("gauge", "minivllm:kv_cache_usage_perc",
                         "KV-cache usage. 1 means 100 percent usage.",
                         [(lbl, snapshot.get("kv_cache_usage", 0.0))])
        lines += _scalar("counter", "minivllm:num_preemptions_total",
                         "Cumulative number of preemptions from the engine.",
                         [(lbl, snapshot.get("num_preemptions", 0))])
        lines += _scalar("counter", "minivllm:prefix_cache_queries_total",
                         "Prompt tokens looked up in the prefix cache (whole blocks).",
                         [(lbl, snapshot.get("prefix_cache_queries", 0))])
        lines += _scalar("counter", "minivllm:prefix_cache_hits_total",
                         "Prompt tokens found in the prefix cache (whole blocks).",
                         [(lbl, snapshot.get("prefix_cache_hits", 0))])
        lines += _scalar("counter", "minivllm:prompt_tokens_total",
                         "Number of prefill tokens processed.",
                         [(lbl, snapshot.get("prompt_tokens", 0))])
        lines += _scalar("counter", "minivllm:generation_tokens_total",
                         "Number of generation tokens processed.",
                         [(lbl, snapshot.get("generation_tokens", 0))])
        # Data parallelism: each engine's own gauges and counters beside the totals above.
        engines = snapshot.get("engines") or []
        if engines:
            for key, kind, help_text in (
                    ("num_requests_running", "gauge", "Requests running, per engine."),
                    ("num_requests_waiting", "gauge", "Requests waiting, per engine."),
                    ("kv_cache_usage", "gauge", "KV-cache usage per engine (1: full)."),
                    ("generation_tokens", "counter", "Generation tokens, per engine.")):
                name = f"minivllm:engine_{key}" + ("_total" if kind == "counter" else "")
                lines += _scalar(kind, name, help_text,
                                 [({**lbl, "engine": str(i)}, e.get(key, 0))
                                  for i, e in enumerate(engines)])
        # vLLM's speculative-decoding counters (zero without --speculative-config).
        for key, help_text in (
                ("spec_decode_num_drafts", "Number of speculative steps with drafts."),
                ("spec_decode_num_draft_tokens", "Number of draft tokens proposed."),
                ("spec_decode_num_accepted_tokens", "Number of draft tokens accepted.")):
            if key in snapshot:
                lines += _scalar("counter", f"minivllm:{key}_total", help_text,
                                 [(lbl, snapshot[key])])
        with self._lock:
            totals = self._rows.sum(axis=0)  # every process's row
        success = [({**lbl, "finished_reason": r}, totals[i])
                   for i, r in enumerate(FINISH_REASONS) if r != "abort"]
        lines += _scalar("counter", "minivllm:request_success_total",
                         "Count of successfully processed requests (samples).", success)
        lines += _scalar("counter", "minivllm:request_aborted_total",
                         "Count of requests aborted (client gone, shutdown, engine "
                         "failure) before they finished.",
                         [(lbl, totals[FINISH_REASONS.index("abort")])])
        for attr, *_ in _HISTOGRAMS:
            lines += getattr(self, attr).render(lbl, totals)
        return "\n".join(lines) + "\n"
