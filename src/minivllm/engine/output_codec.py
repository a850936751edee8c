"""Engine outputs across a process boundary, as deltas.

Outputs are cumulative (all text, tokens and logprobs so far); pickling every request's
whole token list each step would cost O(length) per token. OutputEncoder (engine side)
sends what changed since the request's last output, OutputDecoder (frontend side) rebuilds
the cumulative outputs. Only tuples, strings, numbers and lists travel: pickling a
dataclass goes through Python-level __reduce_ex__ (it cost 4 ms per step at batch 256).
The engine process hands the encoder its Requests themselves (EngineCore with
report_requests), so no cumulative output is built there at all; a RequestOutput (an
abort's final output) is encoded the same way.
"""

from __future__ import annotations

from ..outputs import CompletionOutput, RequestMetrics, RequestOutput
from .detokenizer import visible_text
from .llm_engine import PLACEHOLDER_TOKEN
from .sequence import Request


class OutputEncoder:
    """Engine side: turns cumulative RequestOutputs into what changed since the last one
    sent for the same request (text, token ids and logprobs only ever grow)."""

    def __init__(self) -> None:
        self._sent: dict[str, dict] = {}  # rid -> {"samples": {index: (t, n, l)}, "plp": n}

    def encode(self, out: RequestOutput | Request) -> tuple:
        if isinstance(out, Request):
            return self._encode_request(out)
        rid = out.request_id
        state, first = self._state(rid)
        samples = []
        for o in out.outputs:
            t, n, lp = state["samples"].get(o.index, (0, 0, 0))
            if len(o.text) < t or len(o.token_ids) < n:  # not a growth: resend it whole
                t = n = lp = 0
                reset = True
            else:
                reset = False
            logprobs = o.logprobs[lp:] if o.logprobs is not None else None
            samples.append((o.index, reset, o.text[t:], o.token_ids[n:], logprobs,
                            o.cumulative_logprob, o.finish_reason, o.stop_reason))
            state["samples"][o.index] = (len(o.text), len(o.token_ids),
                                         len(o.logprobs) if o.logprobs is not None else 0)
        plp = out.prompt_logprobs
        new_plp = self._new_prompt_logprobs(state, plp)
        prompt = (out.prompt, out.prompt_token_ids) if first else None
        if out.finished:
            del self._sent[rid]
        m = out.metrics
        # Plain tuples and builtins only: pickling a dataclass goes through Python-level
        # __reduce_ex__ and cost ~17 us per output (4 ms per step at batch 256).
        metrics = None if m is None else (m.arrival_time, m.first_scheduled_time,
                                           m.first_token_time, m.finished_time)
        return (rid, prompt, plp is not None, new_plp, metrics, out.num_cached_tokens,
                out.extra or None, out.finished, samples)

    def _encode_request(self, req: Request) -> tuple:
        """The same message as encode(engine.make_output(req)), read straight from the
        request's sequences: only the new tokens are sliced out, nothing cumulative is
        copied or built."""
        rid = req.request_id
        state, first = self._state(rid)
        sent = state["samples"]
        samples = []
        for seq in req.seqs:
            text = visible_text(seq)
            ids, start = seq.token_ids, seq.num_prompt_tokens
            end = len(ids)
            if end > start and ids[-1] == PLACEHOLDER_TOKEN:
                end -= 1  # a pipelined step's token, not read back yet
            lps = seq.logprobs
            t, n, lp = sent.get(seq.index, (0, 0, 0))
            reset = len(text) < t or end - start < n
            if reset:
                t = n = lp = 0
            samples.append((seq.index, reset, text[t:], ids[start + n:end],
                            lps[lp:] if lps is not None else None,
                            seq.cumulative_logprob if lps is not None else None,
                            seq.finish_reason, seq.stop_reason))
            sent[seq.index] = (len(text), end - start, len(lps) if lps is not None else 0)
        plp = req.prompt_logprobs
        new_plp = self._new_prompt_logprobs(state, plp)
        prompt = (req.prompt, req.prompt_token_ids) if first else None
        finished = req.finished
        if finished:
            del self._sent[rid]
        metrics = (req.arrival_time, req.first_scheduled_time, req.first_token_time,
                   req.finished_time)
        return (rid, prompt, plp is not None, new_plp, metrics,
                req.seqs[0].num_cached_tokens or 0, None, finished, samples)

    def _state(self, rid: str) -> tuple[dict, bool]:
        """What was sent for rid so far, and whether nothing was (its first message)."""
        state = self._sent.get(rid)
        if state is None:
            state = self._sent[rid] = {"samples": {}, "plp": 0}
            return state, True
        return state, False

    @staticmethod
    def _new_prompt_logprobs(state: dict, plp: list | None) -> list | None:
        if plp is None or len(plp) == state["plp"]:
            return None
        new = plp[state["plp"]:]
        state["plp"] = len(plp)
        return new

    def forget(self, rid: str) -> None:
        self._sent.pop(rid, None)


class DecodedOutput:
    """One request's output of one step, as the frontend's receiver decoded it: the
    request's cumulative state (text, token ids and logprobs only ever grow) and how far
    each sample had grown at that step. `materialize()` builds the RequestOutput. A
    stream's consumer that skips to the newest output (a server stream that fell behind)
    builds only that one, on its own event loop, instead of the receiver building one per
    step: the receiver shares the frontend's GIL with the loop."""

    __slots__ = ("request_id", "finished", "num_tokens", "_prompt", "_plp", "_num_plp",
                 "_metrics", "_num_cached", "_extra", "_samples")

    def __init__(self, request_id: str, finished: bool, num_tokens: int, prompt: tuple,
                 plp: list | None, metrics: tuple | None, num_cached: int, extra,
                 samples: list) -> None:
        self.request_id = request_id
        self.finished = finished
        self.num_tokens = num_tokens  # generated tokens of the first sample so far
        self._prompt = prompt
        self._plp = plp
        self._num_plp = len(plp) if plp is not None else 0
        self._metrics = metrics
        self._num_cached = num_cached
        self._extra = extra
        self._samples = samples

    @property
    def metrics(self) -> RequestMetrics | None:
        return RequestMetrics(*self._metrics) if self._metrics is not None else None

    @property
    def outputs(self) -> list[CompletionOutput]:
        return self.materialize().outputs

    @property
    def prompt_logprobs(self) -> list | None:
        return self._plp[:self._num_plp] if self._plp is not None else None

    def sample_outputs(self) -> list[CompletionOutput]:
        """The samples as CompletionOutputs, without the RequestOutput around them (a
        server stream needs only these)."""
        return [CompletionOutput(index, text, ids[:n], cum_lp,
                                 lps[:n_lps] if lps is not None else None, finish, stop)
                for index, text, ids, n, lps, n_lps, cum_lp, finish, stop in self._samples]

    def materialize(self) -> RequestOutput:
        return RequestOutput(self.request_id, self._prompt[0], self._prompt[1],
                             self.sample_outputs(), self.finished, self.prompt_logprobs,
                             self.metrics, self._num_cached, self._extra or {})


def sample_outputs(item) -> list[CompletionOutput]:
    """A stream item's samples: a DecodedOutput's built alone, a RequestOutput's as they
    are."""
    return item.sample_outputs() if type(item) is DecodedOutput else item.outputs


def materialize(item):
    """A stream item as its consumer sees it: a DecodedOutput is built into its
    RequestOutput; RequestOutputs and errors pass as they are."""
    return item.materialize() if type(item) is DecodedOutput else item


class OutputDecoder:
    """Frontend side: accumulates OutputEncoder's deltas per request and hands out a
    DecodedOutput per message (the cumulative RequestOutput, built on demand)."""

    def __init__(self) -> None:
        self._state: dict[str, dict] = {}

    def decode(self, msg: tuple) -> DecodedOutput:
        (rid, prompt, has_plp, new_plp, metrics, num_cached, extra, finished, samples) = msg
        state = self._state.get(rid)
        if state is None:
            state = self._state[rid] = {"prompt": (None, []), "plp": [] if has_plp else None,
                                        "samples": {}}
        if prompt is not None:
            state["prompt"] = prompt
        if new_plp:
            if state["plp"] is None:
                state["plp"] = []
            state["plp"].extend(new_plp)
        views = []
        for index, reset, text, token_ids, logprobs, cum_lp, finish, stop in samples:
            s = state["samples"].get(index)
            if s is None or reset:  # a fresh state: earlier DecodedOutputs keep the old one
                s = state["samples"][index] = {"text": "", "ids": [], "lps": None}
            s["text"] += text
            ids = s["ids"]
            ids.extend(token_ids)
            lps = s["lps"]
            if logprobs is not None:
                if lps is None:
                    lps = s["lps"] = []
                lps.extend(logprobs)
            views.append((index, s["text"], ids, len(ids), lps,
                          len(lps) if lps is not None else 0, cum_lp, finish, stop))
        if finished:
            del self._state[rid]
        return DecodedOutput(rid, finished, views[0][3] if views else 0, state["prompt"],
                             state["plp"], metrics, num_cached, extra, views)

    def forget(self, rid: str) -> None:
        self._state.pop(rid, None)


def _map_outputs(events: list, convert, forget) -> list:
    """The events with every output converted (encoded or decoded); the codec forgets a
    request once it was aborted or failed (a finished one it drops itself)."""
    mapped = []
    for ev in events:
        kind = ev[0]
        if kind == "output":
            mapped.append(("output", convert(ev[1])))
        elif kind == "aborted":
            rid, final, live = ev[1], ev[2], ev[3]
            mapped.append(("aborted", rid, convert(final) if final is not None else None, live))
            forget(rid)
        else:
            if kind == "failed":
                forget(ev[1])
            mapped.append(ev)
    return mapped


def encode_events(events: list, encoder: OutputEncoder) -> list:
    return _map_outputs(events, encoder.encode, encoder.forget)


def decode_events(wire: list, decoder: OutputDecoder) -> list:
    return _map_outputs(wire, decoder.decode, decoder.forget)
