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


class OutputDecoder:
    """Frontend side: rebuilds the cumulative RequestOutputs from OutputEncoder's deltas."""

    def __init__(self) -> None:
        self._state: dict[str, dict] = {}

    def decode(self, msg: tuple) -> RequestOutput:
        (rid, prompt, has_plp, new_plp, metrics, num_cached, extra, finished, samples) = msg
        metrics = RequestMetrics(*metrics) if metrics is not None else None
        state = self._state.get(rid)
        if state is None:
            state = self._state[rid] = {"prompt": None, "prompt_token_ids": [],
                                        "plp": [] if has_plp else None, "samples": {}}
        if prompt is not None:
            state["prompt"], state["prompt_token_ids"] = prompt
        if new_plp:
            if state["plp"] is None:
                state["plp"] = []
            state["plp"].extend(new_plp)
        outputs = []
        for index, reset, text, token_ids, logprobs, cum_lp, finish, stop in samples:
            s = state["samples"].get(index)
            if s is None or reset:
                s = state["samples"][index] = {"text": "", "ids": [], "lps": None}
            s["text"] += text
            s["ids"].extend(token_ids)
            if logprobs is not None:
                if s["lps"] is None:
                    s["lps"] = []
                s["lps"].extend(logprobs)
            outputs.append(CompletionOutput(
                index=index, text=s["text"], token_ids=list(s["ids"]),
                cumulative_logprob=cum_lp,
                logprobs=list(s["lps"]) if s["lps"] is not None else None,
                finish_reason=finish, stop_reason=stop))
        if finished:
            del self._state[rid]
        plp = list(state["plp"]) if state["plp"] is not None else None
        return RequestOutput(rid, state["prompt"], state["prompt_token_ids"], outputs,
                             finished, plp, metrics, num_cached, extra or {})

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
