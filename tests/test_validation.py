"""Invalid parameters and prompts raise ValueError with a clear message, and lose nothing."""

import pytest

from minivllm import LLM, SamplingParams


@pytest.mark.parametrize("kwargs,fragment", [
    (dict(temperature=-0.1), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-5), "top_k"),
    (dict(min_p=1.5), "min_p"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(n=0), "n must"),
    (dict(logprobs=-2), "logprobs"),
    (dict(prompt_logprobs=-2), "prompt_logprobs"),
    (dict(logprobs=2.0), "logprobs"),
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=-3.0), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(repetition_penalty=float("inf")), "repetition_penalty"),
    (dict(repetition_penalty=float("nan")), "repetition_penalty"),
    (dict(stop=""), "stop"),
    (dict(stop=["ok", ""]), "stop"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"),
    (dict(min_tokens=-1), "min_tokens"),
    (dict(min_tokens=10, max_tokens=5), "min_tokens"),
    (dict(seed="abc"), "seed"),
    (dict(logit_bias={5: 101.0}), "logit_bias"),
    (dict(logit_bias={"x": 1.0}), "logit_bias"),
    (dict(seed=True), "seed"),
    (dict(stop="x", detokenize=False), "detokenize=False"),
    (dict(detokenize="no"), "detokenize"),
    (dict(allowed_token_ids=[]), "allowed_token_ids is empty"),
    (dict(allowed_token_ids=[3, -1]), "allowed_token_ids"),
    (dict(allowed_token_ids=[3, 1.5]), "allowed_token_ids"),
    (dict(bad_words=["ok", " "]), "bad_words"),
    (dict(bad_words=[7]), "bad_words"),
    (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens"),
    (dict(truncate_prompt_tokens=-2), "truncate_prompt_tokens"),
    (dict(output_kind=5), "output_kind"),
    (dict(output_kind="delta"), "output_kind"),
    (dict(extra_args=[1]), "extra_args"),
    (dict(n=2, best_of=3), "best_of"),
    (dict(logits_processors=[lambda ids, x: x]), "structured_outputs"),
    (dict(guided_decoding={"json": {}}), "structured_outputs"),
])
def test_bad_sampling_params(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        SamplingParams(**kwargs)


def test_good_sampling_params_normalize():
    p = SamplingParams(top_k=-1, stop="x")
    assert p.top_k == 0 and p.stop == ["x"]


def test_vllm_fields_are_accepted():
    """vLLM's SamplingParams fields construct (no TypeError), normalized as vLLM does."""
    from minivllm.sampling_params import RequestOutputKind

    assert SamplingParams(seed=-1).seed is None  # vLLM's "no seed"
    assert SamplingParams(repetition_penalty=3.5).repetition_penalty == 3.5
    p = SamplingParams(n=2, best_of=2, detokenize=False, allowed_token_ids=(5, 7),
                       bad_words=("a b",), truncate_prompt_tokens=-1, output_kind=1,
                       extra_args={"k": 1}, logits_processors=None, guided_decoding=None,
                       logprobs=-1, prompt_logprobs=50)
    assert p.allowed_token_ids == [5, 7] and p.bad_words == ["a b"]
    assert p.output_kind is RequestOutputKind.DELTA and p.extra_args == {"k": 1}
    assert SamplingParams(output_kind=RequestOutputKind.FINAL_ONLY).output_kind == 2
    assert SamplingParams(logits_processors=[]).logits_processors == []


def test_structured_outputs_params_vllm_fields():
    from minivllm import StructuredOutputsParams

    so = StructuredOutputsParams(choice=("yes", "no"), disable_additional_properties=True)
    assert so.choice == ["yes", "no"]
    assert StructuredOutputsParams(json={"type": "object"}, disable_additional_properties=True)
    with pytest.raises(ValueError, match="whitespace_pattern"):
        StructuredOutputsParams(json={"type": "object"}, whitespace_pattern=r"[ ]?")
    assert StructuredOutputsParams(regex="a+", whitespace_pattern=None).regex == "a+"


@pytest.fixture(scope="module")
def llm(tiny_model_dirs):
    return LLM(str(tiny_model_dirs["qwen2"]), skip_tokenizer_init=True, max_model_len=64)


@pytest.mark.parametrize("prompt,fragment", [
    ([], "empty"),
    ([1, 2, 256], "out of vocabulary"),
    ([1, -3], "out of vocabulary"),
    ([1, 2.5], "out of vocabulary"),
    (list(range(3, 68)), "longer than this model's maximum context length of 64"),
])
def test_bad_prompts(llm, prompt, fragment):
    with pytest.raises(ValueError, match=fragment):
        llm.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_offline_output_runs_until_the_context_is_full(llm):
    """vLLM's offline rule: a prompt plus max_tokens over the context is not refused (the
    server's 400); the output stops with "length" once the context is full, and a prompt
    that fills the context exactly gets one token. Neither fails the rest of the batch."""
    short, fits, full = list(range(3, 43)), [5, 6, 7], list(range(3, 67))
    outs = llm.generate([short, fits, full], SamplingParams(max_tokens=30, ignore_eos=True),
                        use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [24, 30, 1]
    assert [o.outputs[0].finish_reason for o in outs] == ["length"] * 3
    unset = llm.generate([short], SamplingParams(max_tokens=None, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0]
    assert len(unset.token_ids) == 24 and unset.finish_reason == "length"
    assert llm.engine.scheduler.pool.all_free()


def test_the_engine_keeps_the_servers_rule(llm):
    """The engine's own add_request (the server's path) still refuses a prompt plus
    max_tokens over the context, and a prompt that leaves no room."""
    with pytest.raises(ValueError, match="maximum context length is 64"):
        llm.engine.add_request(list(range(3, 43)), SamplingParams(max_tokens=30))
    with pytest.raises(ValueError, match="at least one must be left"):
        llm.engine.add_request(list(range(3, 67)), SamplingParams(max_tokens=1))
    assert not llm.engine.has_unfinished_requests()


def test_bad_prompt_in_batch_loses_nothing(llm):
    params = SamplingParams(temperature=0.0, max_tokens=4)
    with pytest.raises(ValueError):
        llm.generate([[5, 6, 7], [9999]], params, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.scheduler.pool.all_free()
    out = llm.generate([[5, 6, 7]], params, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_text_prompt_without_tokenizer(llm):
    with pytest.raises(ValueError, match="tokenizer"):
        llm.generate("hello", use_tqdm=False)


def test_stop_token_outside_vocab(llm):
    with pytest.raises(ValueError, match="stop_token_ids"):
        llm.generate([[5, 6]], SamplingParams(stop_token_ids=[10**6]), use_tqdm=False)


def test_engine_config_errors(tiny_model_dirs):
    with pytest.raises(ValueError, match="block_size"):
        LLM(str(tiny_model_dirs["qwen2"]), skip_tokenizer_init=True, block_size=3)
    with pytest.raises(ValueError, match="does not exist"):
        LLM("/nonexistent/model", skip_tokenizer_init=True)
    with pytest.raises(ValueError, match="KV cache holds"):
        LLM(str(tiny_model_dirs["qwen2"]), skip_tokenizer_init=True, max_model_len=64,
            block_size=4, num_kv_blocks=4)


def test_block_size_defaults_by_device():
    """Blocks of 64 on a GPU (prefill key tiles then load whole), 16 on a CPU; a block
    size given stays as given."""
    import torch

    from minivllm.config import EngineConfig, ModelConfig

    mc = ModelConfig.from_dict({"architectures": ["LlamaForCausalLM"], "vocab_size": 64,
                                "hidden_size": 32, "num_hidden_layers": 1,
                                "num_attention_heads": 2, "intermediate_size": 64,
                                "max_position_embeddings": 128})
    for device, want in (("cpu", 16), ("cuda", 64)):
        cfg = EngineConfig()
        cfg.finalize(mc, torch.device(device))
        assert cfg.block_size == want
    cfg = EngineConfig(block_size=8)
    cfg.finalize(mc, torch.device("cuda"))
    assert cfg.block_size == 8


def test_graph_tokens_default_to_the_step_budget():
    """Prefill and mixed steps replay graphs up to the step budget, at most 8192 tokens (a
    budget of a whole long context would capture dozens); a limit given stays; a negative
    one is an error."""
    import torch

    from minivllm.config import EngineConfig, ModelConfig

    mc = ModelConfig.from_dict({"architectures": ["LlamaForCausalLM"], "vocab_size": 64,
                                "hidden_size": 32, "num_hidden_layers": 1,
                                "num_attention_heads": 2, "intermediate_size": 64,
                                "max_position_embeddings": 32768})
    for kw, want in (({}, 8192), ({"max_num_batched_tokens": 2048}, 2048),
                     ({"enable_chunked_prefill": False}, 8192),
                     ({"max_graph_tokens": 1024}, 1024), ({"max_graph_tokens": 0}, 0)):
        cfg = EngineConfig(**kw)
        cfg.finalize(mc, torch.device("cuda"))
        assert cfg.max_graph_tokens == want, kw
    with pytest.raises(ValueError, match="max_graph_tokens"):
        EngineConfig(max_graph_tokens=-1).finalize(mc, torch.device("cuda"))


def test_max_model_len_within_the_models_context():
    """As vLLM: max_model_len past max_position_embeddings is refused, unless a linear rope
    scaling stretches it (llama3 and longrope scaling already count in it)."""
    import torch

    from minivllm.config import EngineConfig, ModelConfig

    base = {"architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 32,
            "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 64,
            "max_position_embeddings": 128}
    cpu = torch.device("cpu")
    EngineConfig(max_model_len=128).finalize(ModelConfig.from_dict(base), cpu)
    with pytest.raises(ValueError, match="max_model_len=129 is longer than this model's "
                                         "maximum context of 128"):
        EngineConfig(max_model_len=129).finalize(ModelConfig.from_dict(base), cpu)
    linear = {**base, "rope_scaling": {"rope_type": "linear", "factor": 4.0}}
    EngineConfig(max_model_len=512).finalize(ModelConfig.from_dict(linear), cpu)
    with pytest.raises(ValueError, match="rope scaling"):
        EngineConfig(max_model_len=513).finalize(ModelConfig.from_dict(linear), cpu)
    llama3 = {**base, "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 16}}
    with pytest.raises(ValueError, match="max_model_len"):
        EngineConfig(max_model_len=256).finalize(ModelConfig.from_dict(llama3), cpu)


def test_generate_input_forms(llm):
    params = SamplingParams(temperature=0.0, max_tokens=3)
    a = llm.generate([5, 6, 7], params, use_tqdm=False)
    b = llm.generate({"prompt_token_ids": [5, 6, 7]}, params, use_tqdm=False)
    c = llm.generate([[5, 6, 7], [8, 9]], [params, params], use_tqdm=False)
    assert len(a) == len(b) == 1 and len(c) == 2
    assert a[0].outputs[0].token_ids == b[0].outputs[0].token_ids == c[0].outputs[0].token_ids
    assert c[1].prompt_token_ids == [8, 9]
    with pytest.raises(ValueError, match="SamplingParams"):
        llm.generate([[5], [6]], [params], use_tqdm=False)


def test_numpy_token_ids(llm):
    """Token ids as numpy integers, or a numpy array, are token ids (not "out of
    vocabulary"); numpy floats are still refused."""
    import numpy as np

    params = SamplingParams(temperature=0.0, max_tokens=3)
    want = llm.generate([5, 6, 7], params, use_tqdm=False)[0].outputs[0].token_ids
    for prompt in ({"prompt_token_ids": np.array([5, 6, 7])},
                   {"prompt_token_ids": [np.int32(5), np.int64(6), 7]},
                   [np.int64(5), np.int64(6), np.int64(7)], np.array([5, 6, 7])):
        out = llm.generate(prompt, params, use_tqdm=False)
        assert len(out) == 1 and out[0].outputs[0].token_ids == want
        assert all(type(t) is int for t in out[0].prompt_token_ids)
    with pytest.raises(ValueError, match="out of vocabulary"):
        llm.generate({"prompt_token_ids": np.array([5.0, 6.0])}, params, use_tqdm=False)
