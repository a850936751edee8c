"""The engine process's outputs: OutputEncoder reading a Request's sequences directly
(LLMEngine.step_requests) gives the frontend, after OutputDecoder, exactly the cumulative
output LLMEngine.make_output would have built at the same moment, also when the frontend
builds it (DecodedOutput.materialize) only after later steps' deltas have arrived."""

import pytest

from minivllm import SamplingParams
from minivllm.engine.llm_engine import PLACEHOLDER_TOKEN
from minivllm.engine.output_codec import OutputDecoder, OutputEncoder

from test_pipelined_decode import _llm, _with_mixed_runner


def _same(got, want):
    assert got.request_id == want.request_id and got.finished == want.finished
    assert got.prompt == want.prompt and got.prompt_token_ids == want.prompt_token_ids
    assert got.prompt_logprobs == want.prompt_logprobs
    assert got.num_cached_tokens == want.num_cached_tokens
    assert got.metrics == want.metrics
    assert len(got.outputs) == len(want.outputs)
    for g, w in zip(got.outputs, want.outputs):
        assert (g.index, g.text, g.token_ids, g.logprobs, g.cumulative_logprob,
                g.finish_reason, g.stop_reason) == \
               (w.index, w.text, w.token_ids, w.logprobs, w.cumulative_logprob,
                w.finish_reason, w.stop_reason)
        assert PLACEHOLDER_TOKEN not in g.token_ids


@pytest.mark.parametrize("pipelined", [False, True])
def test_encoding_requests_equals_encoding_their_outputs(tiny_text_model_dir, monkeypatch,
                                                         pipelined):
    llm, launches = _llm(tiny_text_model_dir, monkeypatch, pipelined, skip_tokenizer_init=False)
    _with_mixed_runner(llm)
    eng = llm.engine
    free = llm.generate("The weather today is", SamplingParams(
        temperature=0.0, max_tokens=30, ignore_eos=True), use_tqdm=False)[0].outputs[0].text
    arrivals = [
        ("plain", "The weather today is", SamplingParams(temperature=0.0, max_tokens=30,
                                                         ignore_eos=True)),
        ("stop", "The weather today is", SamplingParams(temperature=0.0, max_tokens=30,
                                                        stop=[free[12:17]], ignore_eos=True)),
        ("lp", "Once upon a time", SamplingParams(temperature=0.0, max_tokens=9, logprobs=2,
                                                  ignore_eos=True)),
        ("n2", "A list of fruits:", SamplingParams(n=2, temperature=0.9, seed=3, max_tokens=12,
                                                   ignore_eos=True)),
        ("plp", "Hello there", SamplingParams(temperature=0.0, max_tokens=5, prompt_logprobs=1,
                                              ignore_eos=True)),
        ("late", "Numbers: one two", SamplingParams(temperature=0.0, max_tokens=10,
                                                    ignore_eos=True)),
    ]
    encoder, decoder = OutputEncoder(), OutputDecoder()
    kept, finished = [], set()
    for step in range(200):
        if step < len(arrivals) * 2 and step % 2 == 0:  # staggered arrivals
            rid, prompt, params = arrivals[step // 2]
            eng.add_request(prompt, params, request_id=rid)
        if not eng.has_unfinished_requests() and step >= len(arrivals) * 2:
            break
        reqs = eng.step_requests()
        assert len({r.request_id for r in reqs}) == len(reqs)  # each once
        for req in reqs:
            decoded, want = decoder.decode(encoder.encode(req)), eng.make_output(req)
            assert decoded.num_tokens == len(want.outputs[0].token_ids)
            assert decoded.metrics == want.metrics
            _same(decoded.materialize(), want)
            kept.append((decoded, want))
            if req.finished:
                finished.add(req.request_id)
    assert finished == {rid for rid, _, _ in arrivals} and len(kept) > 40
    for decoded, want in kept:  # built late: later deltas must not leak into older outputs
        _same(decoded.materialize(), want)
    assert not encoder._sent and not decoder._state  # finished requests are forgotten
    assert any(launches) == pipelined
