"""The offline API, shaped like vLLM's: LLM(...).generate(...) and LLM(...).chat(...)."""

from __future__ import annotations

import logging
import numbers
from collections.abc import Sequence as SequenceABC

from .config import EngineConfig, engine_kwargs, resolve_model_path
from .engine.llm_engine import LLMEngine
from .outputs import RequestOutput
from .sampling_params import SamplingParams, generation_config_defaults
from .server.chat_rendering import ChatRenderer

PromptType = str | list[int] | dict


class LLM:
    """An engine for offline batched generation.

    LLM(model=None) uses the default model (SmolLM2-135M-Instruct, prepared on first use).
    `model` may be a Hugging Face folder, a config.json (with load_format="dummy") or a
    .gguf file. generation_config ("auto", "vllm" or a folder, as vLLM's) sets the sampling
    defaults: with "auto" the model folder's generation_config.json (temperature, top_p,
    top_k, min_p, repetition_penalty, max_new_tokens as max_tokens); see
    get_default_sampling_params().
    """

    def __init__(self, model: str | None = None, *, tokenizer: str | None = None,
                 dtype: str = "auto", max_model_len: int | None = None,
                 max_num_seqs: int = 256, max_num_batched_tokens: int | None = None,
                 block_size: int | None = None, gpu_memory_utilization: float = 0.9,
                 enforce_eager: bool = False, load_format: str = "auto",
                 seed: int | None = 0, device: str = "auto", skip_tokenizer_init: bool = False,
                 generation_config: str = "auto", **kwargs) -> None:
        self.config = EngineConfig(
            model=model, tokenizer=tokenizer, dtype=dtype, max_model_len=max_model_len,
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            block_size=block_size, gpu_memory_utilization=gpu_memory_utilization,
            enforce_eager=enforce_eager, load_format=load_format, seed=seed, device=device,
            skip_tokenizer_init=skip_tokenizer_init, generation_config=generation_config,
            **engine_kwargs(kwargs))
        # Read before the engine is built: a malformed file fails fast.
        self.default_sampling_overrides = generation_config_defaults(
            self.config.generation_config, resolve_model_path(self.config.model)[1])
        _show_engine_logs()
        self.replicas = None
        own = self.config
        if self.config.data_parallel_size > 1:  # the other engines, in processes
            from .engine.data_parallel import OfflineReplicas, replica_configs
            own, *others = replica_configs(self.config, self.config.data_parallel_size)
            self.replicas = OfflineReplicas(others)
        self.engine = LLMEngine(own)
        self._chat_renderer: ChatRenderer | None = None

    @property
    def llm_engine(self) -> LLMEngine:
        """vLLM's name for the engine (this process's, under data parallelism)."""
        return self.engine

    def get_tokenizer(self):
        return self.engine.tokenizer

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prompt block (of every engine under data parallelism), so a
        later prompt computes its KV again; running requests keep their blocks. Returns
        True, as vLLM's does once the cache is cleared."""
        if self.replicas is not None:
            self.replicas.reset_prefix_cache()
        return self.engine.reset_prefix_cache()

    def get_default_sampling_params(self) -> SamplingParams:
        """The SamplingParams that generate() and chat() use when given none: the
        generation config's defaults (see generation_config), else SamplingParams()."""
        return SamplingParams(**self.default_sampling_overrides)

    def generate(self, prompts: PromptType | SequenceABC[PromptType],
                 sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
                 use_tqdm: bool = True, *, lora_request=None,
                 priority: int | SequenceABC[int] | None = None) -> list[RequestOutput]:
        """Generate for every prompt (see docs/sampling.md). As vLLM's offline rule, only
        a prompt longer than max_model_len is refused; an output that would pass the
        context ends there with "length". lora_request: None only (LoRA is not
        supported); priority: None or 0 (requests run first come, first served)."""
        _check_lora(lora_request)
        if priority is not None and any(p != 0 for p in (
                priority if isinstance(priority, SequenceABC) else [priority])):
            raise ValueError("priority is not supported: requests run first come, first "
                             f"served; pass priority=None (or 0), got {priority!r}.")
        prompt_list = _as_prompt_list(prompts)
        # The defaults' max_new_tokens is cut to each prompt's room (the server's rule).
        default_max_tokens = sampling_params is None
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params_list = _as_params_list(sampling_params, len(prompt_list))
        if self.replicas is not None and len(prompt_list) > 1:
            return self.replicas.generate(
                lambda p, s: self._generate_here(p, s, use_tqdm, default_max_tokens),
                prompt_list, params_list, default_max_tokens)
        return self._generate_here(prompt_list, params_list, use_tqdm, default_max_tokens)

    def _generate_here(self, prompt_list: list, params_list: list, use_tqdm: bool,
                       default_max_tokens: bool = False) -> list[RequestOutput]:
        if not prompt_list:
            return []
        # Validate everything before queueing anything: a bad prompt loses nothing.
        request_ids = []
        try:
            for prompt, params in zip(prompt_list, params_list):
                request_ids.append(self.engine.add_request(
                    prompt, params, stream=False, default_max_tokens=default_max_tokens,
                    fill_context=True))
        except Exception:
            for rid in request_ids:
                self.engine.abort_request(rid)
            raise
        return self._run(request_ids, use_tqdm)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
             use_tqdm: bool = True, lora_request=None, chat_template: str | None = None,
             chat_template_content_format: str = "auto", add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: list[dict] | None = None,
             chat_template_kwargs: dict | None = None,
             mm_processor_kwargs: dict | None = None) -> list[RequestOutput]:
        """Render each conversation through the chat template (its tools too, as the
        server renders them) and generate; vLLM's arguments in vLLM's order.
        continue_final_message: the last (assistant) message is continued, not closed
        (add_generation_prompt must then be False). Message content is rendered as a
        string ("auto" or "string"); lora_request and mm_processor_kwargs: None only."""
        _check_lora(lora_request)
        if chat_template_content_format not in ("auto", "string"):
            raise ValueError("chat_template_content_format must be 'auto' or 'string' "
                             "(message content is rendered as a string), got "
                             f"{chat_template_content_format!r}.")
        if mm_processor_kwargs:
            raise ValueError("mm_processor_kwargs is not supported: minivllm runs "
                             "text-only models.")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both "
                             "be True: pass add_generation_prompt=False to continue the "
                             "last message.")
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        if self._chat_renderer is None:
            self._chat_renderer = ChatRenderer(self.engine.tokenizer)
        prompts = []
        for conv in conversations:
            text = self._chat_renderer.render(
                conv, tools=tools, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, chat_template=chat_template,
                chat_template_kwargs=chat_template_kwargs)
            ids = self.engine.tokenize(text, add_special_tokens=False)
            prompts.append({"prompt": text, "prompt_token_ids": ids})
        return self.generate(prompts, sampling_params, use_tqdm)

    # vLLM's pooling and beam-search entry points: not part of minivllm.
    def encode(self, *args, **kwargs):
        raise NotImplementedError(_NO_POOLING.format("encode"))

    def embed(self, *args, **kwargs):
        raise NotImplementedError(_NO_POOLING.format("embed"))

    def classify(self, *args, **kwargs):
        raise NotImplementedError(_NO_POOLING.format("classify"))

    def reward(self, *args, **kwargs):
        raise NotImplementedError(_NO_POOLING.format("reward"))

    def score(self, *args, **kwargs):
        raise NotImplementedError(_NO_POOLING.format("score"))

    def beam_search(self, *args, **kwargs):
        raise NotImplementedError("LLM.beam_search is not supported by minivllm: use "
                                  "generate() with n > 1 (sampled) or greedy decoding.")

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        pending = set(request_ids)
        finished: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm
            bar = tqdm(total=len(request_ids), desc="Processed prompts", dynamic_ncols=True)
        try:
            while pending:
                for out in self.engine.step():
                    if out.finished and out.request_id in pending:
                        finished[out.request_id] = out
                        pending.discard(out.request_id)
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            for rid in pending:
                self.engine.abort_request(rid)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [finished[rid] for rid in request_ids]


_NO_POOLING = ("LLM.{} is not supported by minivllm: it runs generative models only (no "
               "pooling, embedding, classification or scoring models); use generate() or "
               "chat().")


def _check_lora(lora_request) -> None:
    if lora_request is not None:
        raise ValueError("LoRA is not supported by minivllm: lora_request must be None.")


def _as_prompt_list(prompts) -> list[PromptType]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, numbers.Integral) for t in prompts):
        return [prompts]  # one prompt given as token ids (numpy's integers too)
    if not prompts:
        raise ValueError("No prompts given.")
    return prompts


def _as_params_list(params, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"Got {len(params)} SamplingParams for {n} prompts.")
    return params


def _show_engine_logs() -> None:
    """Start-up progress (compile, graph capture, their times) on stderr at INFO, as vLLM
    prints it, unless the application has configured logging itself."""
    pkg = logging.getLogger("minivllm")
    if logging.getLogger().handlers or pkg.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(name)s: %(message)s",
                                           "%H:%M:%S"))
    pkg.addHandler(handler)
    pkg.setLevel(logging.INFO)
