"""The offline API's surface beside vLLM's: LLM's arguments, generate() and chat()'s
keywords, vLLM's attributes and methods."""

import pytest

from minivllm import LLM, SamplingParams
from minivllm.config import EngineConfig, engine_kwargs

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_text_model_dir):
    return LLM(str(tiny_text_model_dir), max_model_len=256, block_size=16)


def test_vllm_arguments_at_neutral_values_are_accepted(tiny_model_dirs):
    """vLLM's arguments that change nothing here are taken at their neutral values (any
    value for those that never matter) and dropped; others are a ValueError naming them."""
    neutral = dict(swap_space=8, disable_log_stats=True, max_seq_len_to_capture=4096,
                   enable_lora=False, distributed_executor_backend="mp",
                   compilation_config={"level": 3}, download_dir="/tmp/x",
                   tokenizer_mode="auto", revision=None, tokenizer_revision=None,
                   served_model_name="m", task="generate", runner="auto", hf_overrides=None,
                   limit_mm_per_prompt={"image": 0}, async_scheduling=True,
                   enable_sleep_mode=False, disable_custom_all_reduce=True, cpu_offload_gb=0,
                   pipeline_parallel_size=1, enable_expert_parallel=False,
                   calculate_kv_scales=False, config_format="auto",
                   disable_sliding_window=False, scheduling_policy="fcfs",
                   logprobs_mode="raw_logprobs", allowed_local_media_path="")
    assert engine_kwargs({**neutral, "num_kv_blocks": 64}) == {"num_kv_blocks": 64}
    for name, value in (("enable_lora", True), ("pipeline_parallel_size", 2),
                        ("cpu_offload_gb", 4), ("task", "embed"), ("revision", "main"),
                        ("enable_sleep_mode", True), ("distributed_executor_backend", "ray"),
                        ("hf_overrides", {"rope_theta": 1.0}), ("tokenizer_mode", "slow"),
                        ("scheduling_policy", "priority"),
                        ("logprobs_mode", "processed_logprobs")):
        with pytest.raises(ValueError, match=f"does not support {name}="):
            engine_kwargs({name: value})
    with pytest.raises(ValueError, match="'max_lorras'"):
        LLM(str(tiny_model_dirs["qwen2"]), skip_tokenizer_init=True, max_lorras=2)
    llm = LLM(str(tiny_model_dirs["qwen2"]), skip_tokenizer_init=True, max_model_len=64,
              **neutral)
    assert llm.generate([5, 6], GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def test_seed_none_is_a_random_engine_seed():
    seeds = {EngineConfig(seed=None).seed for _ in range(3)}
    assert len(seeds) > 1 and all(isinstance(s, int) for s in seeds)
    assert EngineConfig(seed=7).seed == 7
    with pytest.raises(ValueError, match="seed"):
        EngineConfig(seed="7")


def test_llm_with_seed_none(tiny_model_dirs):
    llm = LLM(str(tiny_model_dirs["qwen2"]), skip_tokenizer_init=True, max_model_len=64,
              seed=None)
    params = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    assert len(llm.generate([5, 6], params, use_tqdm=False)[0].outputs[0].token_ids) == 8


def test_generate_takes_vllms_keywords(llm):
    want = llm.generate("Hello", GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    got = llm.generate("Hello", GREEDY, use_tqdm=False, lora_request=None, priority=None)
    assert got[0].outputs[0].token_ids == want
    assert llm.generate(["Hello"], GREEDY, use_tqdm=False, priority=[0])[0].outputs[0]
    with pytest.raises(ValueError, match="LoRA is not supported"):
        llm.generate("Hello", GREEDY, lora_request=object())
    with pytest.raises(ValueError, match="priority"):
        llm.generate(["Hello", "Hi"], GREEDY, priority=[0, 1])
    assert not llm.engine.has_unfinished_requests()


def test_chat_renders_tools_as_the_server_does(llm):
    """tools reach the prompt the server's way (this template shows none: a system
    message with their schemas and the call format); the output is generated as for any
    prompt."""
    from minivllm.server.chat_rendering import ChatRenderer
    from minivllm.server.tool_calls import tools_system_prompt

    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    out = llm.chat(messages, GREEDY, use_tqdm=False, tools=tools)[0]
    renderer = ChatRenderer(llm.get_tokenizer())
    assert not renderer.template_renders_tools
    assert out.prompt == renderer.render(messages, tools=tools)
    assert tools_system_prompt(tools, renderer.tool_format) in out.prompt
    assert "get_weather" not in llm.chat(messages, GREEDY, use_tqdm=False)[0].prompt
    assert len(out.outputs[0].token_ids) == 4


def test_chat_continues_the_final_message(llm):
    messages = [{"role": "user", "content": "Name a city."},
                {"role": "assistant", "content": "The city is"}]
    out = llm.chat(messages, GREEDY, use_tqdm=False, add_generation_prompt=False,
                   continue_final_message=True)[0]
    assert out.prompt.endswith("<|im_start|>assistant\nThe city is")
    closed = llm.chat(messages, GREEDY, use_tqdm=False, add_generation_prompt=False)[0]
    assert closed.prompt.endswith("The city is<|im_end|>\n")
    with pytest.raises(ValueError, match="continue_final_message"):
        llm.chat(messages, GREEDY, continue_final_message=True)


def test_chat_takes_vllms_keywords(llm):
    messages = [{"role": "user", "content": "Hi"}]
    want = llm.chat(messages, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    got = llm.chat(messages, GREEDY, False, None, None, "auto", True, False, None, None, None)
    assert got[0].outputs[0].token_ids == want
    assert llm.chat(messages, GREEDY, use_tqdm=False,
                    chat_template_content_format="string")[0].outputs[0].token_ids == want
    with pytest.raises(ValueError, match="LoRA"):
        llm.chat(messages, GREEDY, lora_request="adapter")
    with pytest.raises(ValueError, match="chat_template_content_format"):
        llm.chat(messages, GREEDY, chat_template_content_format="openai")
    with pytest.raises(ValueError, match="mm_processor_kwargs"):
        llm.chat(messages, GREEDY, mm_processor_kwargs={"num_crops": 4})


def test_llm_engine_and_reset_prefix_cache(llm):
    """llm.llm_engine is the engine (vLLM's name); reset_prefix_cache() makes a repeated
    prompt compute its KV again."""
    assert llm.llm_engine is llm.engine
    prompt = list(range(100, 180))  # five full blocks of 16
    first = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    again = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == 64
    assert llm.reset_prefix_cache() is True
    after = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert after.num_cached_tokens == 0
    assert after.outputs[0].token_ids == first.outputs[0].token_ids


@pytest.mark.parametrize("method", ["encode", "embed", "classify", "score", "reward",
                                    "beam_search"])
def test_pooling_and_beam_search_are_not_implemented(llm, method):
    with pytest.raises(NotImplementedError, match=f"LLM.{method} is not supported"):
        getattr(llm, method)(["Hello"])
