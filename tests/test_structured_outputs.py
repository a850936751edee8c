"""Structured outputs in the engine: every constraint kind holds (on a random model, whose
free choices are as bad as they get), with n > 1, pipelined or not, through preemption;
the grammar compiles off the step path and is cached on disk; bad constraints are clear
errors."""

from __future__ import annotations

import json
import re

import pytest

from minivllm import LLM, SamplingParams, StructuredOutputsParams
from minivllm.engine.grammar import GrammarCompiler
from minivllm.engine.llm_engine import LLMEngine
from minivllm.config import EngineConfig

# No free-running strings or numbers: a random model may never close them.
SCHEMA = {
    "type": "object",
    "properties": {
        "kind": {"enum": ["cat", "dog", "bird"]},
        "ok": {"type": "boolean"},
        "legs": {"type": "integer", "enum": [0, 2, 4]},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "owner": {"type": "object", "properties": {"vip": {"type": "boolean"}},
                  "required": ["vip"], "additionalProperties": False},
    },
    "required": ["kind", "ok", "legs", "owner"],
    "additionalProperties": False,
}
REGEX = r"[a-c]{2,5}-\d{1,3}"
CHOICES = ["yes", "no", "not sure"]
EBNF = 'root ::= "x=" digit digit? ";"\ndigit ::= [0-9]'

KINDS = {
    "json": (dict(json=SCHEMA, disable_any_whitespace=True), None),
    "regex": (dict(regex=REGEX), lambda t: re.fullmatch(REGEX, t)),
    "choice": (dict(choice=CHOICES), lambda t: t in CHOICES),
    "grammar": (dict(grammar=EBNF), lambda t: re.fullmatch(r"x=\d\d?;", t)),
}


def valid_json(text: str) -> bool:
    obj = json.loads(text)
    assert set(obj) <= set(SCHEMA["properties"]) and {"kind", "ok", "legs", "owner"} <= set(obj)
    assert obj["kind"] in ("cat", "dog", "bird") and isinstance(obj["ok"], bool)
    assert obj["legs"] in (0, 2, 4) and set(obj["owner"]) == {"vip"}
    assert all(t in "abc" for t in obj.get("tags", [])) and len(obj.get("tags", [])) <= 3
    return True


def check(kind: str, text: str) -> None:
    ok = valid_json(text) if kind == "json" else KINDS[kind][1](text)
    assert ok, (kind, text)


PROMPTS = ["Give me an answer:", "Once upon a time", "JSON please"]


def _run(llm: LLM, temperature: float, n: int = 2):
    params = [SamplingParams(temperature=temperature, seed=7, n=n, max_tokens=80,
                             structured_outputs=StructuredOutputsParams(**KINDS[k][0]))
              for k in KINDS]
    kinds = [k for k in KINDS for _ in PROMPTS]
    outs = llm.generate([p for _ in KINDS for p in PROMPTS],
                        [p for p in params for _ in PROMPTS])
    return kinds, outs


@pytest.fixture(scope="module")
def llm(tiny_text_model_dir):
    return LLM(str(tiny_text_model_dir), max_model_len=256, max_num_seqs=16)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_kind_holds(llm, temperature):
    kinds, outs = _run(llm, temperature)
    for kind, out in zip(kinds, outs):
        assert len(out.outputs) == 2
        for c in out.outputs:
            assert c.finish_reason == "stop", (kind, c.text)
            check(kind, c.text)


def test_unconstrained_rows_are_untouched(llm):
    """A constrained request in the batch changes nothing for the others."""
    plain = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    alone = llm.generate(PROMPTS, plain)
    bound = SamplingParams(temperature=0.0, max_tokens=12,
                           structured_outputs=StructuredOutputsParams(regex=REGEX))
    mixed = llm.generate(PROMPTS + PROMPTS, [plain] * 3 + [bound] * 3)
    assert [o.outputs[0].token_ids for o in mixed[:3]] == [o.outputs[0].token_ids for o in alone]
    for o in mixed[3:]:
        check("regex", o.outputs[0].text)


def test_same_tokens_unpipelined_and_through_preemption(tiny_text_model_dir, llm,
                                                         monkeypatch):
    """Seeded constrained requests draw the same tokens step by step (no pipelining) and
    with a KV cache so small that sequences are preempted and recomputed."""
    _, want = _run(llm, 1.0)
    monkeypatch.setenv("MINIVLLM_PIPELINE", "0")
    _, sync = _run(LLM(str(tiny_text_model_dir), max_model_len=256, max_num_seqs=16), 1.0)
    monkeypatch.delenv("MINIVLLM_PIPELINE")
    small = LLM(str(tiny_text_model_dir), max_model_len=128, max_num_seqs=16,
                num_kv_blocks=12, block_size=16)
    _, squeezed = _run(small, 1.0)
    tokens = [[c.token_ids for c in o.outputs] for o in want]
    assert [[c.token_ids for c in o.outputs] for o in sync] == tokens
    assert [[c.token_ids for c in o.outputs] for o in squeezed] == tokens
    assert small.engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("kwargs,needle", [
    (dict(json={"type": "objec"}), "Invalid json"),
    (dict(json="{not json"), "Invalid json"),
    (dict(regex="(ab"), "Invalid regex"),
    (dict(grammar="root ::= undefined_rule"), "Invalid grammar"),
    (dict(choice=[]), "non-empty list"),
    (dict(), "exactly one"),
    (dict(regex="a", choice=["a"]), "exactly one"),
    (dict(structural_tag='{"type": "structural_tag", "format": {"type": "nope"}}'),
     "Invalid structural tag"),
])
def test_bad_constraints_are_clear_errors(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        SamplingParams(structured_outputs=StructuredOutputsParams(**kwargs))


def test_grammar_waits_outside_the_batch_and_aborts_cleanly(llm):
    """A request waits for its grammar without holding the batch; aborted while it waits,
    it leaves nothing behind."""
    engine: LLMEngine = llm.engine
    schema = {"type": "object", "properties": {"n": {"enum": [1, 2, 3]}},
              "required": ["n"], "additionalProperties": False}
    so = StructuredOutputsParams(json={**schema, "title": "abort-me"},
                                 disable_any_whitespace=True)
    rid = engine.add_request("hi", SamplingParams(max_tokens=5, structured_outputs=so))
    assert engine._awaiting_grammar and not engine.scheduler.has_work()
    engine.abort_request(rid)
    so2 = StructuredOutputsParams(json={**schema, "title": "run-me"},
                                  disable_any_whitespace=True)
    rid2 = engine.add_request("hi", SamplingParams(max_tokens=20, structured_outputs=so2))
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert list(done) == [rid2] and json.loads(done[rid2].outputs[0].text)["n"] in (1, 2, 3)
    assert not engine._awaiting_grammar and engine._num_constrained == 0
    assert engine.scheduler.pool.num_free == engine.runner.num_blocks


def test_compiled_grammars_are_cached_on_disk(tiny_text_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("MINIVLLM_CACHE_DIR", str(tmp_path))
    from minivllm.tokenizer import load_tokenizer
    tok = load_tokenizer(tiny_text_model_dir)
    so = StructuredOutputsParams(json=SCHEMA)
    first = GrammarCompiler(tok, 49152, [2])
    first.submit(so).result()
    assert first.compiled == 1
    second = GrammarCompiler(tok, 49152, [2])
    second.submit(so).result()
    assert second.compiled == 0  # read from <cache>/grammars
    assert any((tmp_path / "grammars").rglob("tokenizer_info.json"))


def test_needs_a_tokenizer(tiny_text_model_dir):
    engine = LLMEngine(EngineConfig(model=str(tiny_text_model_dir), max_model_len=64,
                                    skip_tokenizer_init=True, max_num_seqs=2))
    with pytest.raises(ValueError, match="tokenizer"):
        engine.add_request([5, 6, 7], SamplingParams(
            structured_outputs=StructuredOutputsParams(regex="a+")))


@pytest.fixture
def drafts_always_pay(monkeypatch):
    """The draft-length policy's timing put aside (see test_speculative.py)."""
    from minivllm.engine.speculative import BatchGate, StepCost
    monkeypatch.setattr(StepCost, "token_share", lambda self, tokens: 0.0)
    monkeypatch.setattr(BatchGate, "open", lambda self: True)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculative_decoding_under_grammars(tiny_text_model_dir, llm, method,
                                             drafts_always_pay):
    """Constrained requests speculate (a mask per draft position; n-gram drafts clipped to
    what the grammar allows, the text it forces proposed as drafts; the draft model
    proposes under the masks) and give token for token what they give without it."""
    _, want = _run(llm, 1.0)
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
            "prompt_lookup_max": 4} if method == "ngram" else {
        "method": "draft_model", "model": str(tiny_text_model_dir), "num_speculative_tokens": 3}
    fast = LLM(str(tiny_text_model_dir), max_model_len=256, max_num_seqs=16,
               speculative_config=spec)
    kinds, got = _run(fast, 1.0)
    assert [[c.token_ids for c in o.outputs] for o in got] == \
        [[c.token_ids for c in o.outputs] for o in want]
    assert fast.engine.stats["spec_decode_num_accepted_tokens"] > 0
    for kind, out in zip(kinds, got):
        for c in out.outputs:
            check(kind, c.text)
    assert fast.engine.scheduler.pool.all_free()
