"""The request bodies of the HTTP API as pydantic models, for ``/openapi.json`` and ``/docs``.

The codecs validate requests themselves (and answer in their protocol's error shape); these
models only *describe* what they accept, so that ``/openapi.json`` is a truthful contract: a body
that follows the schema is served or refused for a reason the schema cannot express (a prompt
longer than the context, a JSON schema xgrammar cannot compile), with the protocol's 4xx, never
a 5xx. ``model`` is an enum of the one name this server serves.

A protocol route that a plugin adds for a path not listed here may describe its body with an
optional codec attribute ``openapi_request_schema`` (a JSON schema); without one its body is
documented as any JSON object.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["ERROR_STATUSES", "REQUEST_MODELS", "protocol_paths"]

Temperature2 = Field(None, ge=0, le=2, description="sampling temperature; 0 is greedy")
TopP = Field(None, ge=0, le=1, description="nucleus sampling mass")
Penalty = Field(None, ge=-2, le=2)
NonEmpty = Field(min_length=1)


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")  # unknown fields are ignored by the codecs


class _Part(BaseModel):
    model_config = ConfigDict(extra="allow")


# -- OpenAI Chat Completions --------------------------------------------------------------------
class TextPart(_Part):
    type: Literal["text"]
    text: str


class FunctionCall(_Part):
    name: str = NonEmpty
    arguments: Optional[str] = Field(None, description="JSON text of the arguments")


class ChatToolCall(_Part):
    id: Optional[str] = None
    type: Literal["function"] = "function"
    function: FunctionCall


class SystemMessage(_Part):
    role: Literal["system", "developer", "user"]
    content: Union[str, list[TextPart]]
    name: Optional[str] = None


class AssistantMessage(_Part):
    role: Literal["assistant"]
    content: Union[str, list[TextPart], None] = None
    reasoning_content: Optional[str] = Field(None, description="DeepSeek's extension: the turn's reasoning")
    tool_calls: Optional[list[ChatToolCall]] = None
    name: Optional[str] = None


class ToolMessage(_Part):
    role: Literal["tool"]
    content: Union[str, list[TextPart]]
    tool_call_id: str


class FunctionSpec(_Part):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = Field(None, description="a JSON schema of the arguments")


class ChatTool(_Part):
    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(_Part):
    name: str


class ChatToolChoice(_Part):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(_Part):
    name: str = Field(min_length=1, max_length=64)
    schema_: Optional[dict[str, Any]] = Field(None, alias="schema", description="the JSON schema replies follow")
    strict: Optional[bool] = None


class ResponseFormat(_Part):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = Field(None, description="required when type is json_schema")


class Thinking(_Part):
    type: Literal["enabled", "disabled"]


class StreamOptions(_Part):
    include_usage: Optional[bool] = None


Effort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]
StopText = Annotated[str, Field(min_length=1)]
Stop = Union[StopText, Annotated[list[StopText], Field(max_length=4)]]


class ChatCompletionRequest(_Body):
    """OpenAI Chat Completions (``POST /v1/chat/completions``), with DeepSeek's ``thinking`` and
    ``reasoning_effort`` and vLLM's ``min_tokens``."""

    model: str
    messages: list[Union[SystemMessage, AssistantMessage, ToolMessage]] = NonEmpty
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    max_tokens: Optional[int] = Field(None, ge=1, description="older name of max_completion_tokens")
    temperature: Optional[float] = Temperature2
    top_p: Optional[float] = TopP
    presence_penalty: Optional[float] = Penalty
    frequency_penalty: Optional[float] = Penalty
    min_tokens: Optional[int] = Field(None, ge=0)
    seed: Optional[int] = None
    stop: Optional[Stop] = Field(None, description="up to 4 non-empty strings")
    stream: Optional[bool] = None
    stream_options: Optional[StreamOptions] = None
    n: Optional[Literal[1]] = None
    logprobs: Optional[Literal[False]] = Field(None, description="log probabilities are not returned")
    top_logprobs: Optional[Literal[0]] = None
    tools: Optional[list[ChatTool]] = None
    tool_choice: Union[Literal["none", "auto", "required"], ChatToolChoice, None] = None
    parallel_tool_calls: Optional[bool] = None
    response_format: Optional[ResponseFormat] = None
    thinking: Optional[Thinking] = None
    reasoning_effort: Optional[Effort] = None
    user: Optional[str] = None


# -- OpenAI Responses ---------------------------------------------------------------------------
class InputText(_Part):
    type: Literal["input_text", "output_text", "text"]
    text: str


class InputMessage(_Part):
    type: Optional[Literal["message"]] = None
    role: Literal["user", "assistant", "system", "developer"]
    content: Union[str, list[InputText]]


class FunctionCallItem(_Part):
    type: Literal["function_call"]
    name: str
    call_id: str
    arguments: Optional[str] = None


class FunctionCallOutputItem(_Part):
    type: Literal["function_call_output"]
    call_id: str
    output: str


class ResponsesTool(_Part):
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None


class ResponsesToolChoice(_Part):
    type: Literal["function"]
    name: str


class TextFormat(_Part):
    type: Literal["text", "json_object", "json_schema"]
    name: Optional[str] = Field(None, description="required when type is json_schema")
    schema_: Optional[dict[str, Any]] = Field(None, alias="schema")
    strict: Optional[bool] = None


class TextConfig(_Part):
    format: Optional[TextFormat] = None


class Reasoning(_Part):
    effort: Optional[Effort] = None


class ResponsesRequest(_Body):
    """OpenAI Responses (``POST /v1/responses``), stateless: no ``previous_response_id``."""

    model: str
    input: Union[str, list[Union[InputMessage, FunctionCallItem, FunctionCallOutputItem]]] = NonEmpty
    instructions: Optional[str] = None
    max_output_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = Temperature2
    top_p: Optional[float] = TopP
    stream: Optional[bool] = None
    tools: Optional[list[ResponsesTool]] = None
    tool_choice: Union[Literal["none", "auto", "required"], ResponsesToolChoice, None] = None
    parallel_tool_calls: Optional[bool] = None
    text: Optional[TextConfig] = None
    reasoning: Optional[Reasoning] = None
    metadata: Optional[dict[str, str]] = None
    top_logprobs: Optional[Literal[0]] = None


# -- Anthropic Messages -------------------------------------------------------------------------
class TextBlock(_Part):
    type: Literal["text"]
    text: str


class ThinkingBlock(_Part):
    type: Literal["thinking"]
    thinking: str
    signature: Optional[str] = None


class ToolUseBlock(_Part):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(_Part):
    type: Literal["tool_result"]
    tool_use_id: str
    content: Union[str, list[TextBlock], None] = None
    is_error: Optional[bool] = None


class AnthropicMessage(_Part):
    role: Literal["user", "assistant"]
    content: Union[str, list[Union[TextBlock, ThinkingBlock, ToolUseBlock, ToolResultBlock]]]


class AnthropicTool(_Part):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: Optional[str] = None
    input_schema: dict[str, Any]


class AnthropicToolChoice(_Part):
    type: Literal["auto", "any", "tool", "none"]
    name: Optional[str] = Field(None, description="required when type is tool")
    disable_parallel_tool_use: Optional[bool] = None


class AnthropicThinking(_Part):
    type: Literal["enabled", "disabled"]
    budget_tokens: Optional[int] = Field(None, ge=1)


class OutputConfig(_Part):
    effort: Optional[Literal["low", "medium", "high", "max"]] = None


class Metadata(_Part):
    user_id: Optional[str] = None


class MessagesRequest(_Body):
    """Anthropic Messages (``POST /v1/messages``)."""

    model: str
    max_tokens: int = Field(ge=1)
    messages: list[AnthropicMessage] = NonEmpty
    system: Union[str, list[TextBlock], None] = None
    temperature: Optional[float] = Field(None, ge=0, le=1)
    top_p: Optional[float] = TopP
    top_k: Optional[int] = Field(None, ge=0)
    stop_sequences: Optional[list[StopText]] = None
    stream: Optional[bool] = None
    tools: Optional[list[AnthropicTool]] = None
    tool_choice: Optional[AnthropicToolChoice] = None
    thinking: Optional[AnthropicThinking] = None
    output_config: Optional[OutputConfig] = None
    metadata: Optional[Metadata] = None


# -- Completions (the core's own codec) ---------------------------------------------------------
class CompletionRequest(_Body):
    """OpenAI's legacy Completions (``POST /v1/completions``): one prompt, text or token ids."""

    model: str
    prompt: Union[str, list[int], list[str]] = Field(description="a non-empty string or token ids; one prompt")
    max_tokens: Optional[int] = Field(16, ge=1)
    temperature: Optional[float] = Temperature2
    top_p: Optional[float] = TopP
    presence_penalty: Optional[float] = Penalty
    frequency_penalty: Optional[float] = Penalty
    stop: Optional[Stop] = Field(None, description="up to 4 non-empty strings")
    stream: Optional[bool] = None
    stream_options: Optional[StreamOptions] = None
    seed: Optional[int] = None
    n: Optional[Literal[1]] = None
    ignore_eos: Optional[bool] = Field(None, description="vLLM's extension: run to max_tokens")
    min_tokens: Optional[int] = Field(None, ge=0)


SUMMARIES = {
    "/v1/chat/completions": "Chat Completions (OpenAI)",
    "/v1/responses": "Responses (OpenAI, stateless)",
    "/v1/messages": "Messages (Anthropic)",
    "/v1/completions": "Completions: a plain prompt, text or token ids (OpenAI legacy)",
}

REQUEST_MODELS: dict[str, type[BaseModel]] = {
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/responses": ResponsesRequest,
    "/v1/messages": MessagesRequest,
    "/v1/completions": CompletionRequest,
}

ERROR_STATUSES = {
    "400": "invalid request: bad JSON, a field out of range, a prompt longer than the context, a schema "
    "xgrammar cannot compile (the message names the field)",
    "404": "the model named is not the one this server serves",
    "429": "the waiting queue is full; retry after Retry-After seconds",
    "503": "the server is draining",
}

_ERROR_SCHEMA = {
    "type": "object",
    "description": "the protocol's own error shape: {error: {message, type, param, code}} (OpenAI) or "
    "{type: 'error', error: {type, message}} (Anthropic)",
    "required": ["error"],
    "properties": {"error": {"type": "object", "required": ["message"], "properties": {"message": {"type": "string"}}}},
}


def _request_schema(path: str, codec, served_model: str, components: dict) -> dict:
    model = REQUEST_MODELS.get(path)
    if model is None:
        return getattr(codec, "openapi_request_schema", None) or {"type": "object"}
    schema = model.model_json_schema(by_alias=True, ref_template="#/components/schemas/{model}")
    components.update(schema.pop("$defs", {}))
    schema["properties"]["model"] = {"type": "string", "enum": [served_model], "description": "the served model"}
    return schema


def protocol_paths(codecs: dict, served_model: str) -> tuple[dict, dict]:
    """OpenAPI ``paths`` for every codec route, and the component schemas they refer to."""
    paths: dict = {}
    components: dict = {}
    for codec in codecs.values():
        for method, path in codec.routes:
            schema = _request_schema(path, codec, served_model, components)
            title = schema.get("title", path)
            components[title] = schema
            responses = {
                "200": {
                    "description": "the reply; with stream: true, server-sent events",
                    "content": {"application/json": {"schema": {"type": "object"}}, "text/event-stream": {}},
                },
                **{
                    status: {"description": text, "content": {"application/json": {"schema": _ERROR_SCHEMA}}}
                    for status, text in ERROR_STATUSES.items()
                },
            }
            paths.setdefault(path, {})[method.lower()] = {
                "summary": SUMMARIES.get(path, codec.name),
                "description": schema.get("description", ""),
                "operationId": f"{codec.name}.{method.lower()}",
                "tags": ["protocols"],
                "requestBody": {
                    "required": True,
                    "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{title}"}}},
                },
                "responses": responses,
            }
    return paths, components
