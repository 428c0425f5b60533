"""The one table of request fields that the API of SGLang (0.5.23: its OpenAI routes'
`CompletionRequest` / `ChatCompletionRequest`, `/generate`'s `GenerateReqInput` and its
`SamplingParams`) or of vLLM / OpenAI defines and this engine takes without acting on them.

The fields the engine honours (`echo`, `no_stop_trim`, `ignore_eos`, `continue_final_message`,
`max_completion_tokens`, ...) are declared in the request models of `engine.server.schemas`.
Every other field of those APIs is a row here: accepted (and dropped) when its value is one of
those the row takes (its default, or a value that asks nothing of this engine), refused with a
400 naming it otherwise. A field that no API defines is neither: it is an unknown field.

Gateways send many of these with every request they forward: `sglang-router` 0.3 adds
`no_stop_trim`, `continue_final_message`, `separate_reasoning`, `return_hidden_states`, ... to
chat bodies and `log_metrics`, `background`, `no_logs`, `return_bytes`, ... to `/generate`;
`sglang.bench_serving` sends `return_routed_experts` and `lora_path`. All at their defaults.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# Where a row applies: the top level of a completion, chat or /generate body, /generate's
# `sampling_params`, an OpenAI body's `stream_options`, a chat message.
COMPLETION, CHAT, GENERATE, SAMPLING, STREAM_OPTIONS, MESSAGE = (
    "completion", "chat", "generate", "sampling_params", "stream_options", "message")
OPENAI = (COMPLETION, CHAT)
ALL = (COMPLETION, CHAT, GENERATE)


def only(*values: Any) -> Callable[[Any], bool]:
    """Takes null and exactly these values (of their type: `0` is not `False`)."""
    return lambda v: v is None or any(v == x and type(v) is type(x) for x in values)


def empty(v: Any) -> bool:
    return v is None or v == [] or v == {} or v == ""


def bool_any(v: Any) -> bool:
    return v is None or isinstance(v, bool)


def str_any(v: Any) -> bool:
    return v is None or isinstance(v, str)


def anything(v: Any) -> bool:
    return True


@dataclass(frozen=True)
class Row:
    where: tuple[str, ...]
    takes: Callable[[Any], bool]
    # What a value the row does not take asks for (the refusal says it).
    asks: str


_NONE = only()
_FALSE = only(False)
_ROWS: dict[str, Row] = {
    # --- tools and reasoning (no tool-call or reasoning parser here) ---
    "tools": Row(OPENAI, empty, "tool calling"),
    "tool_choice": Row(OPENAI, only("none", "auto"), "a tool call"),
    "functions": Row(OPENAI, empty, "tool calling"),
    "function_call": Row(OPENAI, only("none", "auto"), "a tool call"),
    "parallel_tool_calls": Row(OPENAI, bool_any, "tool calling"),
    # Without a reasoning parser (SGLang's --reasoning-parser) these change nothing, there too.
    "separate_reasoning": Row((CHAT,), bool_any, "a reasoning parser"),
    "stream_reasoning": Row((CHAT,), bool_any, "a reasoning parser"),
    "reasoning_effort": Row((CHAT,), _NONE, "a reasoning budget"),
    "thinking": Row((CHAT,), _NONE, "a thinking mode"),
    "task": Row((CHAT,), _NONE, "a DeepSeek quick-instruction task"),
    "require_reasoning": Row((GENERATE,), _FALSE, "a reasoning model's thinking"),
    "max_thinking_tokens": Row((GENERATE,), _NONE, "a thinking budget"),
    # --- OpenAI completions features not implemented ---
    "best_of": Row(OPENAI, only(1), "best-of-n sampling"),
    "suffix": Row(OPENAI, only(""), "fill-in-the-middle"),
    "stop_regex": Row((*OPENAI, SAMPLING), empty, "stop regexes"),
    "structural_tag": Row((SAMPLING,), _NONE, "structural tags"),
    "beam_width": Row((SAMPLING,), only(1), "beam search"),
    # How often a stream sends an event; the text is the same (every step sends one here).
    "stream_interval": Row((SAMPLING,), lambda v: v is None or type(v) is int and v > 0,
                           "a positive stream interval"),
    "spaces_between_special_tokens": Row((SAMPLING,), only(True),
                                         "no spaces between special tokens"),
    # vLLM's structured output (use response_format or /generate's sampling_params).
    "guided_json": Row(OPENAI, _NONE, "vLLM's guided decoding"),
    "guided_regex": Row(OPENAI, _NONE, "vLLM's guided decoding"),
    "guided_grammar": Row(OPENAI, _NONE, "vLLM's guided decoding"),
    "guided_choice": Row(OPENAI, _NONE, "vLLM's guided decoding"),
    # --- outputs this engine does not produce ---
    "return_hidden_states": Row(ALL, only(False), "hidden states"),
    "return_routed_experts": Row(ALL, _FALSE, "MoE routing records"),
    "routed_experts_start_len": Row(ALL, only(0), "MoE routing records"),
    "return_indexer_topk": Row((GENERATE,), _FALSE, "indexer top-k records"),
    "return_cached_tokens_details": Row(OPENAI, _FALSE, "per-tier cached-token details"),
    "return_spec_tokens_details": Row(OPENAI, _FALSE, "speculative decoding details"),
    "return_token_ids": Row(OPENAI, _FALSE, "token ids in the choices"),
    "return_prompt_token_ids": Row((CHAT, GENERATE), _FALSE, "the prompt's token ids"),
    "return_meta_info": Row((CHAT,), _FALSE, "SGLang's meta_info in the choices"),
    "return_input_ids_in_sglext": Row((CHAT,), _FALSE, "SGLang's sglext block"),
    "return_output_ids_in_sglext": Row((CHAT,), _FALSE, "SGLang's sglext block"),
    "return_sampling_mask": Row((CHAT, GENERATE), _FALSE, "sampling masks"),
    "sampling_logprobs_mode": Row((CHAT, GENERATE), _NONE, "sampling-support logprobs"),
    "return_flat_raw_top_logprobs": Row((GENERATE,), _FALSE, "flat logprob arrays"),
    "return_flat_raw_output_top_logprobs": Row((CHAT, GENERATE), _FALSE, "flat logprob arrays"),
    # Only shapes the flat arrays refused above.
    "return_flat_raw_top_logprobs_b64": Row((CHAT, GENERATE), bool_any, "flat logprob arrays"),
    "token_ids_logprob": Row((GENERATE,), empty, "logprobs of chosen token ids"),
    "return_entropy": Row((GENERATE,), _FALSE, "output entropies"),
    "return_bytes": Row((GENERATE,), _FALSE, "image bytes"),
    "continuous_usage_stats": Row((STREAM_OPTIONS,), _FALSE, "usage in every streamed chunk"),
    # --- adapters, sessions, custom processors, watermarks, multimodal input ---
    "lora_path": Row(ALL, _NONE, "a LoRA adapter"),
    "lora_id": Row((GENERATE,), _NONE, "a LoRA adapter"),
    "session_id": Row(ALL, _NONE, "a session"),
    "session_params": Row(ALL, empty, "a session"),
    "custom_logit_processor": Row(ALL, _NONE, "a custom logit processor"),
    "custom_params": Row((*OPENAI, SAMPLING), empty, "a custom logit processor"),
    "watermark": Row((*ALL, SAMPLING), empty, "watermarking"),
    "image_data": Row((GENERATE,), empty, "image input"),
    "video_data": Row((GENERATE,), empty, "video input"),
    "audio_data": Row((GENERATE,), empty, "audio input"),
    "input_embeds": Row((GENERATE,), _NONE, "input embeddings"),
    "positional_embed_overrides": Row((GENERATE,), _NONE, "input embeddings"),
    "modalities": Row((GENERATE,), empty, "multimodal input"),
    "mm_hashes": Row((GENERATE,), empty, "multimodal input"),
    "mm_content_hashes": Row((GENERATE,), empty, "multimodal input"),
    "use_audio_in_video": Row((CHAT, GENERATE), _FALSE, "multimodal input"),
    "video_config": Row((CHAT, GENERATE), empty, "multimodal input"),
    "images_config": Row(ALL, empty, "multimodal input"),
    "mm_processor_kwargs": Row(ALL, empty, "multimodal input"),
    "max_dynamic_patch": Row((CHAT, GENERATE), _NONE, "multimodal input"),
    "min_dynamic_patch": Row((CHAT, GENERATE), _NONE, "multimodal input"),
    "image_max_dynamic_patch": Row((GENERATE,), _NONE, "multimodal input"),
    "video_max_dynamic_patch": Row((GENERATE,), _NONE, "multimodal input"),
    "need_wait_for_mm_inputs": Row((GENERATE,), _FALSE, "multimodal input"),
    "num_items_assigned": Row((GENERATE,), empty, "multimodal input"),
    "encoder_urls": Row((GENERATE,), empty, "multimodal input"),
    "multi_item_delimiter_indices": Row((GENERATE,), empty, "multi-item scoring"),
    "token_indices_to_pool": Row((GENERATE,), empty, "pooled readouts"),
    # --- scheduling, disaggregation and data-parallel routing (one rank, no PD split) ---
    "priority": Row(ALL, _NONE, "priority scheduling"),
    "background": Row((GENERATE,), _FALSE, "a background response"),
    "bootstrap_host": Row(ALL, empty, "prefill/decode disaggregation"),
    "bootstrap_port": Row(ALL, empty, "prefill/decode disaggregation"),
    "bootstrap_room": Row(ALL, empty, "prefill/decode disaggregation"),
    "bootstrap_pair_key": Row((GENERATE,), empty, "prefill/decode disaggregation"),
    "decode_tp_size": Row((GENERATE,), _NONE, "prefill/decode disaggregation"),
    "disagg_prefill_dp_rank": Row(ALL, _NONE, "prefill/decode disaggregation"),
    "kv_hints": Row((GENERATE,), empty, "orchestrator KV hints"),
    "routed_dp_rank": Row(ALL, only(0), "a data-parallel rank other than 0"),
    "data_parallel_rank": Row(ALL, only(0), "a data-parallel rank other than 0"),
    # --- what is done with the request's data ---
    "log_metrics": Row((GENERATE,), only(True), "a request left out of the metrics"),
    "no_logs": Row((GENERATE,), _FALSE, "a request left out of the logs"),
    # --- names and trace context: they ask nothing of the engine, any value is taken ---
    "routing_key": Row((GENERATE,), str_any, "a routing key"),
    "conversation_id": Row((GENERATE,), str_any, "a conversation id"),
    "custom_labels": Row(ALL, anything, "metric labels"),
    "external_trace_header": Row((GENERATE,), anything, "a trace context"),
    "received_time": Row((GENERATE,), anything, "a receive time"),
    "http_worker_ipc": Row((GENERATE,), _NONE, "a tokenizer worker"),
    # --- chat message fields ---
    "tool_call_id": Row((MESSAGE,), _NONE, "tool calling"),
    "tool_calls": Row((MESSAGE,), empty, "tool calling"),
    "reasoning_content": Row((MESSAGE,), empty, "a reasoning parser"),
    "phase": Row((MESSAGE,), _NONE, "a response phase"),
    "prefix": Row((MESSAGE,), only(False), "a prefix completion (use continue_final_message)"),
}
# The MESSAGE rows' `tools` (a system message's) shares the name of the body's: a second table.
_MESSAGE_EXTRA: dict[str, Row] = {"tools": Row((MESSAGE,), empty, "tool calling")}

TABLES: dict[str, dict[str, Row]] = {
    where: {name: row for name, row in _ROWS.items() if where in row.where}
    for where in (COMPLETION, CHAT, GENERATE, SAMPLING, STREAM_OPTIONS, MESSAGE)
}
TABLES[MESSAGE].update(_MESSAGE_EXTRA)
