"""The one table of request fields: every field of the APIs this server speaks (OpenAI's,
vLLM's and SGLang 0.5.23's: its OpenAI routes' `CompletionRequest` / `ChatCompletionRequest`,
`/generate`'s `GenerateReqInput` and its `SamplingParams`) that a route takes, one row each.

A row is one of three kinds (`Row.kind`):

* `honoured`: the engine does what the field asks (`Row.does` says what). The request models of
  `engine.server.schemas` declare exactly these fields (a test holds them to this table).
* `default only`: accepted (and dropped) when its value asks nothing of this engine (its
  default, or a value such as `store: false` / `service_tier: "auto"`), refused with a 400
  naming it otherwise (`Row.asks`: what another value would ask for).
* `any value`: a name or label that asks nothing of the engine (`metadata`, `user`,
  `safety_identifier`, `prompt_cache_key`...): taken whatever its value.

A field that no API defines is none of these: it is an unknown field.

Gateways send many of these with every request they forward: `sglang-router` 0.3 adds
`no_stop_trim`, `continue_final_message`, `separate_reasoning`, `return_hidden_states`, ... to
chat bodies and `log_metrics`, `background`, `no_logs`, `return_bytes`, ... to `/generate`;
`sglang.bench_serving` sends `return_routed_experts` and `lora_path`; guidellm sends
`stream_options.continuous_usage_stats`; the openai SDK's users `store`, `metadata`,
`prompt_cache_key`, `service_tier`, `safety_identifier`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# Where a row applies: the top level of a completion, chat or /generate body, /generate's
# `sampling_params`, an OpenAI body's `stream_options` or `structured_outputs`, a chat message.
COMPLETION, CHAT, GENERATE, SAMPLING, STREAM_OPTIONS, STRUCTURED, MESSAGE = (
    "completion", "chat", "generate", "sampling_params", "stream_options", "structured_outputs",
    "message")
OPENAI = (COMPLETION, CHAT)
ALL = (COMPLETION, CHAT, GENERATE)
SCOPES = (COMPLETION, CHAT, GENERATE, SAMPLING, STREAM_OPTIONS, STRUCTURED, MESSAGE)

HONOURED, DEFAULT_ONLY, ANY_VALUE = "honoured", "default only", "any value"


class only:  # noqa: N801 - reads as a predicate in the table
    """Takes null and exactly these values (of their type: `0` is not `False`); the first is
    the field's default."""

    def __init__(self, *values: Any) -> None:
        self.values = values
        self.default = values[0] if values else None

    def __call__(self, v: Any) -> bool:
        return v is None or any(v == x and type(v) is type(x) for x in self.values)


def empty(v: Any) -> bool:
    return v is None or v == [] or v == {} or v == ""


def bool_any(v: Any) -> bool:
    return v is None or isinstance(v, bool)


def str_any(v: Any) -> bool:
    return v is None or isinstance(v, str)


def anything(v: Any) -> bool:
    return True


def nulls(v: Any) -> bool:
    """null, or SGLang's list form of one request (or a batch): a list of nulls."""
    return v is None or isinstance(v, list) and all(x is None for x in v)


def text_only(v: Any) -> bool:
    """No modality, or text alone (what the OpenAI SDK's `modalities: ["text"]` asks)."""
    return empty(v) or v == ["text"]


def str_map(v: Any) -> bool:
    """OpenAI's `metadata`: string keys to string values."""
    return v is None or isinstance(v, dict) and all(isinstance(x, str) for x in v.values())


@dataclass(frozen=True)
class Row:
    name: str
    where: tuple[str, ...]
    takes: Callable[[Any], bool]
    # What a value the row does not take asks for (the refusal says it); for an honoured row,
    # what the engine does with the field.
    asks: str
    honoured: bool = False

    @property
    def kind(self) -> str:
        if self.honoured:
            return HONOURED
        return ANY_VALUE if self.takes in (anything, str_any, str_map) else DEFAULT_ONLY

    @property
    def default(self) -> Any:
        """The value the API defines as the default (None where it is null or unset)."""
        return getattr(self.takes, "default", None)


R = Row


def H(name: str, where: tuple[str, ...], does: str) -> Row:
    """An honoured row: the request models declare it and the engine does `does`."""
    return Row(name, where, anything, does, honoured=True)


_COMP, _CHAT, _GEN, _SP = (COMPLETION,), (CHAT,), (GENERATE,), (SAMPLING,)
_HONOURED: list[Row] = [
    # --- the prompt ---
    H("prompt", _COMP, "the prompt: text, token ids, or a batch of either"),
    H("messages", _CHAT, "the conversation, through the model's chat template"),
    H("input_ids", (CHAT, GENERATE), "the prompt as token ids (chat: no template)"),
    H("text", _GEN, "the prompt, or a batch of prompts"),
    H("model", ALL, "checked against nothing: one model is served"),
    H("add_special_tokens", OPENAI,
      "BOS and other special tokens added when the prompt is tokenized (vLLM: completions "
      "default true, chat false: the template has them)"),
    H("add_generation_prompt", _CHAT, "the template's assistant header (default true)"),
    H("continue_final_message", _CHAT,
      "a last assistant message is continued, not closed (vLLM's and SGLang's)"),
    H("chat_template_kwargs", _CHAT, "extra variables of the chat template"),
    H("truncate_prompt_tokens", OPENAI,
      "keep the prompt's last k tokens (-1: as many as the context takes)"),
    H("echo", OPENAI, "the prompt's text in front of the completion (chat: the last message's, "
      "when it is the answer's role, as vLLM)"),
    # --- length and stopping ---
    H("max_tokens", OPENAI, "the most tokens to generate"),
    H("max_completion_tokens", _CHAT, "max_tokens under OpenAI's newer name (it wins)"),
    H("max_new_tokens", _SP, "the most tokens to generate"),
    H("min_tokens", OPENAI, "stop tokens held back until this many tokens are out"),
    H("min_new_tokens", _SP, "min_tokens under SGLang's name"),
    H("stop", (*OPENAI, SAMPLING), "stop strings"),
    H("stop_token_ids", (*OPENAI, SAMPLING), "stop tokens"),
    H("ignore_eos", (*OPENAI, SAMPLING), "generation goes on past EOS"),
    H("no_stop_trim", (*OPENAI, SAMPLING), "the stop string / token stays in the text"),
    H("include_stop_str_in_output", OPENAI, "vLLM's no_stop_trim"),
    H("skip_special_tokens", (*OPENAI, SAMPLING), "special tokens left out of the text"),
    # --- sampling ---
    H("temperature", (*OPENAI, SAMPLING), "sampling temperature (0: greedy)"),
    H("top_p", (*OPENAI, SAMPLING), "nucleus sampling"),
    H("top_k", (*OPENAI, SAMPLING), "top-k sampling"),
    H("min_p", (*OPENAI, SAMPLING), "min-p sampling"),
    H("seed", (*OPENAI, SAMPLING), "a per-request seed"),
    H("sampling_seed", _SP, "seed under SGLang's name"),
    H("n", (*OPENAI, SAMPLING), "n samples of each prompt, sharing its pages"),
    H("frequency_penalty", (*OPENAI, SAMPLING), "OpenAI's frequency penalty"),
    H("presence_penalty", (*OPENAI, SAMPLING), "OpenAI's presence penalty"),
    H("repetition_penalty", (*OPENAI, SAMPLING), "vLLM's / HF's repetition penalty"),
    H("logit_bias", (*OPENAI, SAMPLING), "a bias per token id"),
    H("allowed_token_ids", OPENAI, "only these token ids are sampled"),
    H("bad_words", OPENAI, "these words are never generated (vLLM's: each word's tokens, with "
      "and without a leading space, banned where the output ends with the tokens before)"),
    # --- structured output ---
    H("response_format", OPENAI, "OpenAI's json_object / json_schema"),
    H("structured_outputs", OPENAI, "vLLM's json / regex / choice / grammar / json_object"),
    H("json_schema", (COMPLETION, SAMPLING), "SGLang's JSON schema constraint"),
    H("regex", (*OPENAI, SAMPLING, STRUCTURED), "a regex constraint"),
    H("ebnf", (*OPENAI, SAMPLING), "SGLang's EBNF grammar constraint"),
    H("guided_json", OPENAI, "vLLM's older name of structured_outputs.json"),
    H("guided_regex", OPENAI, "vLLM's older name of structured_outputs.regex"),
    H("guided_choice", OPENAI, "vLLM's older name of structured_outputs.choice"),
    H("guided_grammar", OPENAI, "vLLM's older name of structured_outputs.grammar"),
    H("json", (STRUCTURED,), "a JSON schema (an object or its text)"),
    H("choice", (STRUCTURED,), "one of these strings"),
    H("grammar", (STRUCTURED,), "an EBNF grammar (xgrammar's GBNF)"),
    H("json_object", (STRUCTURED,), "any JSON object"),
    # --- logprobs ---
    H("logprobs", OPENAI, "the chosen tokens' logprobs (completions: and the top k)"),
    H("top_logprobs", _CHAT, "the top k alternatives per token"),
    H("prompt_logprobs", OPENAI, "vLLM's prompt_logprobs: the prompt's, with the top k"),
    H("return_tokens_as_token_ids", OPENAI, "logprob tokens shown as token_id:<id>"),
    H("return_logprob", _GEN, "SGLang's logprobs"),
    H("top_logprobs_num", _GEN, "the top k alternatives per token"),
    H("logprob_start_len", _GEN, "the first prompt position with logprobs"),
    H("return_text_in_logprobs", _GEN, "each logprob with its token's text"),
    # --- the response ---
    H("stream", ALL, "server-sent events"),
    H("return_cached_tokens_details", OPENAI, "usage.prompt_tokens_details.cache_outcomes: the "
      "prompt's tokens by hit tier and miss cause (n == 1)"),
    H("stream_options", OPENAI, "what a stream adds (usage)"),
    H("include_usage", (STREAM_OPTIONS,), "a last chunk with the usage"),
    H("continuous_usage_stats", (STREAM_OPTIONS,),
      "with include_usage, the usage so far in every chunk (vLLM's)"),
    H("rid", ALL, "the response's id (SGLang's; a one-element list for one request, at "
      "/generate one per prompt)"),
    H("request_id", OPENAI, "vLLM's: the response's id is cmpl- / chatcmpl- and this"),
    # --- the cache ---
    H("extra_key", ALL, "the cache namespace (a list: one per prompt, as rid)"),
    H("cache_salt", ALL, "the cache namespace (a tenant salt)"),
    H("skip_cache_write", ALL, "the request's new pages stay on the device (never host or L3) "
      "and are evicted first"),
    H("retention_seconds", ALL, "a soft pin of the request's prefix for this long (at most "
      "--max-retention-seconds)"),
    H("priority", ALL, "the cache priority of the request's pages (the priority eviction "
      "policy evicts lower first; not a scheduling order)"),
    # --- chat messages ---
    H("role", (MESSAGE,), "the speaker"),
    H("content", (MESSAGE,), "text, or text parts"),
    H("name", (MESSAGE,), "given to the chat template"),
    # --- /generate's body ---
    H("sampling_params", _GEN, "SGLang's sampling parameters"),
]
_NONE = only()
_FALSE = only(False)
_DEFAULT_ONLY: list[Row] = [
    # --- OpenAI's fields with no generation semantics (the openai SDK's current ones) ---
    R("store", OPENAI, _FALSE, "storing the completion for OpenAI's dashboard"),
    R("metadata", OPENAI, str_map, "string metadata"),
    # Prefix caching here is automatic (every prompt's pages are looked up); the key neither
    # namespaces nor routes (cache_salt / extra_key namespace; a gateway routes by prefix).
    R("prompt_cache_key", OPENAI, str_any, "a prompt cache key"),
    R("service_tier", OPENAI, only("auto", "default"), "a paid service tier (flex, priority)"),
    R("safety_identifier", OPENAI, str_any, "a safety identifier"),
    R("user", OPENAI, str_any, "a user name"),
    R("audio", _CHAT, _NONE, "audio output"),
    R("prediction", OPENAI, _NONE, "a predicted output"),
    R("web_search_options", _CHAT, _NONE, "web search"),
    R("verbosity", _CHAT, _NONE, "a verbosity level"),
    # --- vLLM's request fields (0.11+) this engine takes at their defaults ---
    R("use_beam_search", OPENAI, _FALSE, "beam search"),
    R("length_penalty", OPENAI, only(1.0, 1), "a beam-search length penalty"),
    R("documents", _CHAT, empty, "documents in the chat template (RAG)"),
    R("chat_template", _CHAT, _NONE, "a chat template of the request's own"),
    R("logits_processors", OPENAI, empty, "custom logits processors"),
    R("kv_transfer_params", OPENAI, empty, "KV transfer (prefill/decode disaggregation)"),
    R("vllm_xargs", OPENAI, empty, "vLLM extension arguments"),
    R("prompt_embeds", _COMP, _NONE, "prompt embeddings"),
    R("include_reasoning", _CHAT, bool_any, "a reasoning parser"),
    R("media_io_kwargs", _CHAT, empty, "multimodal input"),
    R("thinking_token_budget", _CHAT, _NONE, "a thinking budget"),
    # --- tools and reasoning (no tool-call or reasoning parser here) ---
    R("tools", OPENAI, empty, "tool calling"),
    R("tool_choice", OPENAI, only("none", "auto"), "a tool call"),
    R("functions", OPENAI, empty, "tool calling"),
    R("function_call", OPENAI, only("none", "auto"), "a tool call"),
    R("parallel_tool_calls", OPENAI, bool_any, "tool calling"),
    # Without a reasoning parser (SGLang's --reasoning-parser) these change nothing, there too.
    R("separate_reasoning", (CHAT,), bool_any, "a reasoning parser"),
    R("stream_reasoning", (CHAT,), bool_any, "a reasoning parser"),
    R("reasoning_effort", (CHAT,), _NONE, "a reasoning budget"),
    R("thinking", (CHAT,), _NONE, "a thinking mode"),
    R("task", (CHAT,), _NONE, "a DeepSeek quick-instruction task"),
    R("require_reasoning", (GENERATE,), _FALSE, "a reasoning model's thinking"),
    R("max_thinking_tokens", (GENERATE,), _NONE, "a thinking budget"),
    # --- OpenAI completions features not implemented ---
    R("best_of", OPENAI, only(1), "best-of-n sampling"),
    R("suffix", OPENAI, only(""), "fill-in-the-middle"),
    R("stop_regex", (*OPENAI, SAMPLING), empty, "stop regexes"),
    R("beam_width", (SAMPLING,), only(1), "beam search"),
    # How often a stream sends an event; the text is the same (every step sends one here).
    R("stream_interval", (SAMPLING,), lambda v: v is None or type(v) is int and v > 0,
                           "a positive stream interval"),
    R("spaces_between_special_tokens", (*OPENAI, SAMPLING), only(True),
                                         "no spaces between special tokens"),
    # --- outputs this engine does not produce ---
    R("return_hidden_states", ALL, only(False), "hidden states"),
    R("return_routed_experts", ALL, _FALSE, "MoE routing records"),
    R("routed_experts_start_len", ALL, only(0), "MoE routing records"),
    R("return_indexer_topk", (GENERATE,), _FALSE, "indexer top-k records"),
    R("return_spec_tokens_details", OPENAI, _FALSE, "speculative decoding details"),
    R("return_token_ids", OPENAI, _FALSE, "token ids in the choices"),
    R("return_prompt_token_ids", (CHAT, GENERATE), _FALSE, "the prompt's token ids"),
    R("return_meta_info", (CHAT,), _FALSE, "SGLang's meta_info in the choices"),
    R("return_input_ids_in_sglext", (CHAT,), _FALSE, "SGLang's sglext block"),
    R("return_output_ids_in_sglext", (CHAT,), _FALSE, "SGLang's sglext block"),
    R("return_sampling_mask", (CHAT, GENERATE), _FALSE, "sampling masks"),
    R("sampling_logprobs_mode", (CHAT, GENERATE), _NONE, "sampling-support logprobs"),
    R("return_flat_raw_top_logprobs", (GENERATE,), _FALSE, "flat logprob arrays"),
    R("return_flat_raw_output_top_logprobs", (CHAT, GENERATE), _FALSE, "flat logprob arrays"),
    # Only shapes the flat arrays refused above.
    R("return_flat_raw_top_logprobs_b64", (CHAT, GENERATE), bool_any, "flat logprob arrays"),
    R("token_ids_logprob", (GENERATE,), empty, "logprobs of chosen token ids"),
    R("return_entropy", (GENERATE,), _FALSE, "output entropies"),
    R("return_bytes", (GENERATE,), _FALSE, "image bytes"),
    # --- adapters, sessions, custom processors, watermarks, multimodal input ---
    R("lora_path", ALL, nulls, "a LoRA adapter"),
    R("lora_id", (GENERATE,), _NONE, "a LoRA adapter"),
    R("session_id", ALL, _NONE, "a session"),
    R("session_params", ALL, empty, "a session"),
    R("custom_logit_processor", ALL, _NONE, "a custom logit processor"),
    R("custom_params", (*OPENAI, SAMPLING), empty, "a custom logit processor"),
    R("watermark", (*ALL, SAMPLING), empty, "watermarking"),
    R("image_data", (GENERATE,), empty, "image input"),
    R("video_data", (GENERATE,), empty, "video input"),
    R("audio_data", (GENERATE,), empty, "audio input"),
    R("input_embeds", (GENERATE,), _NONE, "input embeddings"),
    R("positional_embed_overrides", (GENERATE,), _NONE, "input embeddings"),
    R("modalities", (CHAT, GENERATE), text_only, "multimodal input or output"),
    R("mm_hashes", (GENERATE,), empty, "multimodal input"),
    R("mm_content_hashes", (GENERATE,), empty, "multimodal input"),
    R("use_audio_in_video", (CHAT, GENERATE), _FALSE, "multimodal input"),
    R("video_config", (CHAT, GENERATE), empty, "multimodal input"),
    R("images_config", ALL, empty, "multimodal input"),
    R("mm_processor_kwargs", ALL, empty, "multimodal input"),
    R("max_dynamic_patch", (CHAT, GENERATE), _NONE, "multimodal input"),
    R("min_dynamic_patch", (CHAT, GENERATE), _NONE, "multimodal input"),
    R("image_max_dynamic_patch", (GENERATE,), _NONE, "multimodal input"),
    R("video_max_dynamic_patch", (GENERATE,), _NONE, "multimodal input"),
    R("need_wait_for_mm_inputs", (GENERATE,), _FALSE, "multimodal input"),
    R("num_items_assigned", (GENERATE,), empty, "multimodal input"),
    R("encoder_urls", (GENERATE,), empty, "multimodal input"),
    R("multi_item_delimiter_indices", (GENERATE,), empty, "multi-item scoring"),
    R("token_indices_to_pool", (GENERATE,), empty, "pooled readouts"),
    # --- scheduling, disaggregation and data-parallel routing (one rank, no PD split) ---
    R("background", (GENERATE,), _FALSE, "a background response"),
    R("bootstrap_host", ALL, empty, "prefill/decode disaggregation"),
    R("bootstrap_port", ALL, empty, "prefill/decode disaggregation"),
    R("bootstrap_room", ALL, empty, "prefill/decode disaggregation"),
    R("bootstrap_pair_key", (GENERATE,), empty, "prefill/decode disaggregation"),
    R("decode_tp_size", (GENERATE,), _NONE, "prefill/decode disaggregation"),
    R("disagg_prefill_dp_rank", ALL, _NONE, "prefill/decode disaggregation"),
    R("kv_hints", (GENERATE,), empty, "orchestrator KV hints"),
    R("routed_dp_rank", ALL, only(0), "a data-parallel rank other than 0"),
    R("data_parallel_rank", ALL, only(0), "a data-parallel rank other than 0"),
    # --- what is done with the request's data ---
    R("log_metrics", (GENERATE,), only(True), "a request left out of the metrics"),
    R("no_logs", (GENERATE,), _FALSE, "a request left out of the logs"),
    # --- names and trace context: they ask nothing of the engine, any value is taken ---
    R("routing_key", (GENERATE,), str_any, "a routing key"),
    R("conversation_id", (GENERATE,), str_any, "a conversation id"),
    R("custom_labels", ALL, anything, "metric labels"),
    R("external_trace_header", (GENERATE,), anything, "a trace context"),
    R("received_time", (GENERATE,), anything, "a receive time"),
    R("http_worker_ipc", (GENERATE,), _NONE, "a tokenizer worker"),
    # --- chat message fields ---
    R("tool_call_id", (MESSAGE,), _NONE, "tool calling"),
    R("tool_calls", (MESSAGE,), empty, "tool calling"),
    R("reasoning_content", (MESSAGE,), empty, "a reasoning parser"),
    R("phase", (MESSAGE,), _NONE, "a response phase"),
    R("prefix", (MESSAGE,), only(False), "a prefix completion (use continue_final_message)"),
    R("tools", (MESSAGE,), empty, "tool calling"),  # a system message's tools
]
# vLLM's StructuredOutputsParams beyond the constraint itself: their defaults shape nothing.
_STRUCTURED_DEFAULTS: list[Row] = [
    R("disable_fallback", (STRUCTURED,), _FALSE, "a grammar backend without fallback"),
    R("disable_any_whitespace", (STRUCTURED,), _FALSE, "JSON without free whitespace"),
    R("disable_additional_properties", (STRUCTURED,), _FALSE,
      "JSON objects without additional properties"),
    R("whitespace_pattern", (STRUCTURED,), _NONE, "a JSON whitespace pattern"),
    R("structural_tag", (STRUCTURED, SAMPLING), _NONE, "structural tags"),
]

_ROWS: list[Row] = _HONOURED + _DEFAULT_ONLY + _STRUCTURED_DEFAULTS

TABLES: dict[str, dict[str, Row]] = {where: {} for where in SCOPES}
for _row in _ROWS:
    for _where in _row.where:
        if _row.name in TABLES[_where]:
            raise AssertionError(f"two rows for {_where}.{_row.name}")  # a table error
        TABLES[_where][_row.name] = _row
