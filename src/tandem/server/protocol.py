"""OpenAI request bodies (pydantic, strict: a string is never read as a number or a boolean, nor a
boolean as a number). Unknown fields are refused (400 naming the field) rather than silently ignored. Fields past OpenAI's own (`top_k`, `min_p`, `repetition_penalty`, `ignore_eos`,
`stop_token_ids`, `skip_special_tokens`) follow vLLM / SGLang; with the `openai` client pass them
in `extra_body`. Value ranges are checked by `SamplingParams`, in one place.
"""

from __future__ import annotations

import json
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

# Integers cross the process boundary as msgpack int64 and may become torch int64 tensors.
Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM/SGLang: usage so far in every chunk


class JsonSchemaFormat(BaseModel):
    """OpenAI's response_format.json_schema: the schema and its name."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    name: str = "response"
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None  # the output always follows the schema, strict or not


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self):
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.schema_ is None):
            raise ValueError("response_format: type json_schema needs json_schema.schema")
        return self


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` (at most one field)."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    json_: dict | str | None = Field(None, alias="json")
    regex: str | None = None
    grammar: str | None = None
    choice: list[str] | None = None


class SamplingRequest(BaseModel):
    """Fields common to /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    max_tokens: Int64 | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = Field(1, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: Int64 | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    # Accepted and ignored: they cannot change the output.
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    reasoning_effort: str | None = None  # no reasoning phase to shorten: the output is the same
    modalities: list[Literal["text"]] | None = None  # text is the only output there is
    response_format: ResponseFormat | None = None  # text, json_object, json_schema (server/structured.py)
    # Structured output as SGLang and vLLM take it (at most one way per request; server/structured.py)
    json_schema: dict | str | None = None  # SGLang
    regex: str | None = None  # SGLang
    ebnf: str | None = None  # SGLang
    grammar: str | None = None
    guided_json: dict | str | None = None  # vLLM (older)
    guided_regex: str | None = None
    guided_grammar: str | None = None
    guided_choice: list[str] | None = None
    structured_outputs: StructuredOutputs | None = None  # vLLM
    include_stop_str_in_output: bool = False  # vLLM: the text keeps the stop string that ended it
    logit_bias: dict[str, float] | None = None  # OpenAI: token id (as a string) -> bias in [-100, 100]
    min_tokens: Int64 = 0  # vLLM: no EOS or stop token before this many new tokens
    # extensions
    top_k: Int64 = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    stop_token_ids: list[Int64] | None = None
    skip_special_tokens: bool = True

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed when stream is true")
        return self

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


class CompletionRequest(SamplingRequest):
    # a string, strings (a batch), token ids, or lists of token ids (a batch)
    prompt: str | list[str] | list[Int64] | list[list[Int64]]
    logprobs: Int64 | None = None  # top alternatives per token, besides the chosen one
    echo: bool = False  # the prompt before the completion (with logprobs: the prompt's too; max_tokens 0 allowed)
    prompt_logprobs: Int64 | None = None  # vLLM: each prompt token's logprob and the top n there
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=128)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    # extra fields (name, tool_call_id, ...) go to the chat template as they are
    model_config = ConfigDict(extra="allow", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[TextPart] | None = None

    def for_template(self) -> dict:
        msg = self.model_dump(exclude_none=True)
        for call in msg.get("tool_calls") or ():
            # OpenAI sends arguments as JSON text; chat templates write them out as a mapping (vLLM does this too).
            function = call.get("function") if isinstance(call, dict) else None
            if isinstance(function, dict) and isinstance(function.get("arguments"), str):
                try:
                    function["arguments"] = json.loads(function["arguments"])
                except ValueError:
                    pass
        if isinstance(self.content, list):
            msg["content"] = "\n".join(part.text for part in self.content)
        elif self.content is None:
            msg["content"] = ""  # OpenAI allows null (an assistant turn with tool calls); templates read a string
        return msg


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict | None = None  # a JSON schema of the arguments object
    strict: bool | None = None  # calls forced by tool_choice always follow the schema


class ToolDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: Int64 | None = None
    max_completion_tokens: Int64 | None = None  # OpenAI's newer name for max_tokens
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the output continues the last (assistant) message
    chat_template_kwargs: dict | None = None  # extra variables for the chat template
    tools: list[ToolDefinition] | None = None  # rendered through the chat template (server/tools.py)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # false: tool_choice "required" yields exactly one call

    @model_validator(mode="after")
    def _one_way_to_end_the_prompt(self):
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message: needs add_generation_prompt=false (it continues the last "
                             "message instead of starting a new one)")
        return self


class TokenizeRequest(BaseModel):
    """POST /tokenize (as vLLM): a prompt, or chat messages through the chat template."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool = True  # for a prompt
    add_generation_prompt: bool = True  # for messages

    @model_validator(mode="after")
    def _prompt_or_messages(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("prompt: give either prompt or messages")
        return self


class DetokenizeRequest(BaseModel):
    """POST /detokenize (as vLLM)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0, le=2**63 - 1)]]  # token ids (the vocabulary bounds them further)


# ---- response bodies: what the endpoints return (the OpenAPI schema names them; tests check real
# responses against them) ---------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens whose KV the prefix cache held


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    mean_accept_length: float | None = None  # speculative servers only
    spec_verify_steps: int | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobs | None = None
    prompt_logprobs: list[dict[str, dict] | None] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ChatTokenLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[dict] = []


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class ToolCallFunction(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"]
    function: ToolCallFunction


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    finish_reason: str | None
    logprobs: ChatChoiceLogprobs | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int | None


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorBody
