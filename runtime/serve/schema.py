"""What a request may say: OpenAI's request bodies as strict models, APIError (OpenAI's error shape
with its HTTP status), and the translation of a valid request into the runtime's arguments."""
from __future__ import annotations

from typing import Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

DEFAULT_MAX_TOKENS = 256       # when a request names no max_tokens
RETRY_AFTER_S = 1              # what a 429 / 503 tells the client to wait
MAX_STOPS = 16                 # OpenAI's own limit is 4; more costs nothing here
MAX_CHOICES = 16               # n: choices of one request (OpenAI allows 128; each takes a slot)


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def shutting_down() -> APIError:
    return APIError(503, "the server is shutting down", type="server_error", code="server_shutting_down",
                    headers={"Retry-After": str(RETRY_AFTER_S)})


# Strict, as OpenAI's API is: "0.5" is not a float, 1.0 is not an int, 1 is not a bool. A request
# argument this server does not know is refused naming it, as OpenAI's API refuses one; known ones it
# cannot honour are refused too (_ONLY). Inside messages, fields clients echo back from earlier
# responses (refusal, annotations, ...) are ignored: they do not change the prompt.

class Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class Request(Strict):
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(Strict):
    include_usage: bool = False


class ContentPart(Strict):
    type: str
    text: str | None = None


class Message(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None


class Common(Request):
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)       # OpenAI's default and range
    top_p: float = Field(1.0, gt=0, le=1)
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None   # tags for the caller's records: nothing to honour
    timeout: float | None = Field(None, gt=0)  # seconds the request may take (this server's extension)
    response_format: dict | None = None
    # Sampling arguments other OpenAI-compatible servers take (vLLM, llama.cpp's server)
    top_k: int | None = Field(None, ge=-1)              # -1 and 0: every token
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = None


class ChatRequest(Common):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None


class CompletionRequest(Common):
    prompt: str | list[int] | list[str]
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False
    best_of: int = 1
    suffix: str | None = None


# Any other value would change the answer in a way this server cannot honour: refused rather than
# silently ignored.
_ONLY = {
    "best_of": ((1,), "best_of must be 1"),
    "echo": ((False,), "echo is not supported by this server"),
    "suffix": ((None, ""), "suffix is not supported by this server"),
    "tools": ((None, []), "tools are not supported by this server"),
    "logit_bias": ((None, {}), "logit_bias is not supported by this server"),
    "tool_choice": ((None, "none"), "tool_choice is not supported by this server (tools are not)"),
    "parallel_tool_calls": ((None,), "parallel_tool_calls is not supported by this server (tools are not)"),
    "presence_penalty": ((0.0,), "presence_penalty is not supported by this server (only 0)"),
    "frequency_penalty": ((0.0,), "frequency_penalty is not supported by this server (only 0)"),
    "repetition_penalty": ((None, 1.0), "repetition_penalty is not supported by this server (only 1)"),
}


def _is_union_tag(part) -> bool:
    """pydantic names the member of a Union in an error's location ('str', 'list[int]'): not a field."""
    return isinstance(part, str) and (part in {"str", "int", "float", "bool", "none", "dict", "list"} or "[" in part
                                      or part[:1].isupper())


def parse_request(kind, data):
    """Validate a decoded JSON body; raise APIError 400 naming the first bad field."""
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        req = kind.model_validate(data)
    except ValidationError as e:
        first = e.errors(include_url=False)[0]
        param = ".".join(str(p) for p in first["loc"] if not _is_union_tag(p)) or None
        if first["type"] == "extra_forbidden":
            raise APIError(400, f"Unrecognized request argument supplied: {param}", param=param,
                           code="unknown_parameter") from None
        message = f"invalid value for '{param}': {first['msg']}" if param else first["msg"]
        raise APIError(400, message, param=param, code="invalid_value") from None
    for name, (allowed, why) in _ONLY.items():
        if name in kind.model_fields and getattr(req, name) not in allowed:
            raise APIError(400, why, param=name, code="unsupported_value")
    return req


def _message_text(content) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for part in content:
        if part.type != "text" or part.text is None:
            raise APIError(400, f"content parts of type '{part.type}' are not supported (text only)",
                           param="messages")
        texts.append(part.text)
    return "".join(texts)


def chat_prompt(tokenizer, messages) -> list[int]:
    if tokenizer.chat_template is None:
        raise APIError(400, "this model has no chat template: use /v1/completions", param="messages")
    plain = [{"role": m.role, "content": _message_text(m.content)} for m in messages]
    try:
        return tokenizer.apply_chat_template(plain)
    except Exception as e:             # jinja's raise_exception() in templates that refuse a role order
        raise APIError(400, f"the chat template refused these messages: {e}", param="messages") from None


def completion_prompt(tokenizer, prompt) -> list[int]:
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        if len(prompt) != 1:
            raise APIError(400, "only one prompt per request is supported", param="prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        return tokenizer.encode(prompt)
    return list(prompt)


def check_prompt(ids: list[int], max_tokens: int | None, max_length: int, vocab_size: int) -> None:
    """Refused here, before the request waits for a worker, rather than by the worker. A max_tokens
    the context cannot hold is refused, not cut short; without one, the reply may fill the context."""
    if not ids:
        raise APIError(400, "the prompt is empty", param="prompt")
    if len(ids) >= max_length:
        raise APIError(400, f"the prompt has {len(ids)} tokens; this model's context is {max_length} tokens and "
                       "must leave room for at least one new token", param="messages",
                       code="context_length_exceeded")
    if max_tokens is not None and len(ids) + max_tokens > max_length:
        raise APIError(400, f"this model's context is {max_length} tokens, but {len(ids) + max_tokens} were "
                       f"requested ({len(ids)} in the prompt, {max_tokens} for the reply); reduce max_tokens to "
                       f"at most {max_length - len(ids)} or shorten the prompt", param="max_tokens",
                       code="context_length_exceeded")
    if any(not 0 <= t < vocab_size for t in ids):
        raise APIError(400, f"prompt token ids must be in [0, {vocab_size})", param="prompt")


def generation_kwargs(req, max_tokens: int | None) -> dict:
    """Keyword arguments for Generator.events (all but cancel)."""
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stops) > MAX_STOPS or any(not s for s in stops):
        raise APIError(400, f"stop must be up to {MAX_STOPS} non-empty strings", param="stop")
    return dict(max_new_tokens=max_tokens or DEFAULT_MAX_TOKENS, temperature=req.temperature, top_p=req.top_p,
                seed=req.seed, stop=stops, logprobs=requested_logprobs(req), json_schema=requested_json(req),
                sampling_top_k=max(req.top_k or 0, 0), min_p=req.min_p or 0.0)


def requested_json(req) -> dict | bool | None:
    """response_format as the runtime's json_schema: None (text), True (any JSON object), a schema."""
    fmt = req.response_format
    kind = (fmt or {}).get("type", "text")
    if kind == "text" and set(fmt or {}) <= {"type"}:
        return None
    if kind == "json_object" and set(fmt) == {"type"}:
        return True
    spec = fmt.get("json_schema")
    if kind == "json_schema" and set(fmt) == {"type", "json_schema"} and isinstance(spec, dict) \
            and isinstance(spec.get("schema"), dict) and set(spec) <= {"name", "schema", "strict", "description"}:
        return spec["schema"]
    raise APIError(400, "response_format must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                        "{\"type\": \"json_schema\", \"json_schema\": {\"name\": ..., \"schema\": {...}, \"strict\": ...}}",
                   param="response_format", code="invalid_value")


def requested_logprobs(req) -> int | None:
    """How many most likely tokens to list beside each token's log-probability (None: no logprobs):
    chat's logprobs + top_logprobs, completions' logprobs."""
    if not isinstance(req, ChatRequest):
        return req.logprobs
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs", code="invalid_value")
    return (req.top_logprobs or 0) if req.logprobs else None
