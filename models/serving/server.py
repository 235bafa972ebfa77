"""An OpenAI-compatible HTTP server over the engine (:mod:`models.serving.engine`).

::

    python -m models.serve --model smollm2-135m --attention quest --port 8000
    curl localhost:8000/v1/completions -H 'Content-Type: application/json' \\
         -d '{"model": "smollm2-135m", "prompt": "The capital of France is", "max_tokens": 16}'

Endpoints: ``POST /v1/completions`` and ``POST /v1/chat/completions`` (``stream``:
server-sent events, else one JSON body; ``stream_options.include_usage`` and vLLM's
``continuous_usage_stats``), ``GET /v1/models`` and ``/v1/models/{id}``, ``GET /health``
(the engine's counters), ``GET /metrics`` (Prometheus, :mod:`models.serving.metrics`),
``/ping``, ``/version``, and vLLM's ``POST /tokenize`` / ``/detokenize``. FastAPI on uvicorn; the engine runs in its own thread
and each request talks to it through an asyncio queue fed with
``loop.call_soon_threadsafe``.

Every sampling option is applied on the device by the engine's one sampler
(:mod:`models.sampling`): ``temperature``, ``top_p``, ``top_k``, ``min_p``,
``presence_penalty``, ``frequency_penalty``, ``repetition_penalty``, ``min_tokens``,
``logit_bias``, ``seed``, ``stop``, ``ignore_eos``. Log-probabilities: completions'
``logprobs`` (0-20: ``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset``)
and ``echo`` (the prompt's text and, with ``logprobs``, its tokens' log-probabilities, the
first null; ``max_tokens: 0`` scores a prompt without generating: lm-eval's
loglikelihood); chat's ``logprobs`` / ``top_logprobs`` (0-20). ``n`` choices per prompt,
and a list of prompts (strings or token-id lists) in one completions request, each choice
with its ``index`` (``prompt * n + j``; sample ``j`` draws from ``seed + j``).

Bad input gets a 4xx in OpenAI's error shape (``{"error": {"message", "type",
"param", "code"}}``) before any device work: malformed JSON or fields (400),
an unknown model (404), a prompt over the context or ``max_tokens`` past it
(400), unsupported options (``tools``, ``suffix``, ``best_of`` other than ``n``,
``response_format`` other than text: 400, naming the field), an unknown route (404) or
method (405). A client that disconnects cancels its requests, which frees their slots.

Chat: the messages are rendered with the model's own chat template (SmolLM2's
GGUF carries a ChatML template; ``Tokenizer.apply_chat_template``), the
assistant turn opened.

Sampling follows the OpenAI defaults (``temperature`` 1, ``top_p`` 1); a
request without ``seed`` gets a random one. ``max_tokens`` defaults to 16 for
completions (as OpenAI's) and to the rest of the context for chat.
"""

# no `from __future__ import annotations`: FastAPI reads the handlers' annotations at runtime

import asyncio
import contextlib
import dataclasses
import json
import secrets
import time
from typing import Any

import sparse_jax
from models.serving.engine import Engine
from models.serving.metrics import ServerMetrics
from models.serving.requests import MAX_LOGPROBS, Event, Request, SamplingParams, TokenLogprob

# -----------------------------------------------------------------------------
# Request bodies (checked by hand: clear messages, and no pydantic coupling)
# -----------------------------------------------------------------------------


class BadRequest(Exception):
    """A client error: HTTP ``status`` with an OpenAI-style error body."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None, code: str | None = None,
                 type_: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.status, self.param, self.code, self.type = message, status, param, code, type_

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


_UNSUPPORTED = ("suffix", "tools", "functions", "tool_choice", "function_call")

#: the most choices one request may ask for (``n`` x prompts): each is a request of the engine
MAX_CHOICES = 64


# -----------------------------------------------------------------------------
# The request bodies in the OpenAPI schema (/openapi.json): the handlers read and check the
# JSON themselves (above); these describe it for clients and fuzzers (schemathesis)
# -----------------------------------------------------------------------------

_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
_SAMPLING_FIELDS = {
    "model": {"type": "string"}, "max_tokens": {"type": ["integer", "null"], "minimum": 0},
    "max_completion_tokens": {"type": ["integer", "null"], "minimum": 1},
    "temperature": {"type": ["number", "null"], "minimum": 0, "maximum": 2},
    "top_p": {"type": ["number", "null"], "exclusiveMinimum": 0, "maximum": 1},
    "top_k": {"type": ["integer", "null"], "minimum": -1}, "min_p": {"type": ["number", "null"], "minimum": 0,
                                                                      "maximum": 1},
    "presence_penalty": {"type": ["number", "null"], "minimum": -2, "maximum": 2},
    "frequency_penalty": {"type": ["number", "null"], "minimum": -2, "maximum": 2},
    "repetition_penalty": {"type": ["number", "null"], "exclusiveMinimum": 0},
    "min_tokens": {"type": ["integer", "null"], "minimum": 0},
    "logit_bias": {"type": ["object", "null"], "additionalProperties": {"type": "number", "minimum": -100,
                                                                         "maximum": 100}},
    "n": {"type": ["integer", "null"], "minimum": 1, "maximum": 64}, "seed": {"type": ["integer", "null"]},
    "stop": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}, "maxItems": 4},
                       {"type": "null"}]},
    "stream": {"type": ["boolean", "null"]},
    "stream_options": {"type": ["object", "null"], "properties": {"include_usage": {"type": "boolean"},
                                                                   "continuous_usage_stats": {"type": "boolean"}}},
    "ignore_eos": {"type": "boolean"}}
COMPLETIONS_BODY = {"type": "object", "required": ["model", "prompt"], "properties": {
    **_SAMPLING_FIELDS, "prompt": {"anyOf": [{"type": "string"}, _IDS, {"type": "array", "items": {"type": "string"}},
                                            {"type": "array", "items": _IDS}]},
    "echo": {"type": "boolean"}, "logprobs": {"type": ["integer", "null"], "minimum": 0, "maximum": 20},
    "best_of": {"type": ["integer", "null"], "minimum": 1}}}
_MESSAGES = {"type": "array", "minItems": 1, "items": {"type": "object", "required": ["role", "content"], "properties": {
    "role": {"enum": ["system", "developer", "user", "assistant"]},
    "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": {
        "type": "object", "required": ["type", "text"], "properties": {"type": {"const": "text"},
                                                                       "text": {"type": "string"}}}}]}}}}
CHAT_BODY = {"type": "object", "required": ["model", "messages"], "properties": {
    **_SAMPLING_FIELDS, "messages": _MESSAGES, "logprobs": {"type": ["boolean", "null"]},
    "top_logprobs": {"type": ["integer", "null"], "minimum": 0, "maximum": 20}}}
TOKENIZE_BODY = {"type": "object", "properties": {
    "model": {"type": "string"}, "prompt": {"type": "string"}, "messages": _MESSAGES,
    "add_generation_prompt": {"type": "boolean"}, "add_special_tokens": {"type": "boolean"},
    "return_token_strs": {"type": "boolean"}}}
DETOKENIZE_BODY = {"type": "object", "required": ["tokens"], "properties": {"model": {"type": "string"},
                                                                            "tokens": _IDS}}


def _body_schema(schema: dict, model_name: str) -> dict:
    """FastAPI's ``openapi_extra`` for a route whose JSON body is ``schema`` (its ``model``
    the one this server serves)."""
    schema = {**schema, "properties": {**schema["properties"], "model": {"enum": [model_name]}}}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def _number(body: dict, key: str, default: float, lo: float | None = None, hi: float | None = None,
            integer: bool = False):
    v = body.get(key, default)
    if v is None:
        return default
    ok = isinstance(v, int) if integer else isinstance(v, (int, float))
    if isinstance(v, bool) or not ok:
        raise BadRequest(f"'{key}' must be {'an integer' if integer else 'a number'}, got {json.dumps(v)}", param=key)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        rng = f"[{lo if lo is not None else '-inf'}, {hi if hi is not None else 'inf'}]"
        raise BadRequest(f"'{key}' must be in {rng}, got {v}", param=key)
    return v


def _common_params(body: dict, default_max_tokens: int | None, context_left: int,
                   chat: bool = False) -> tuple[SamplingParams, bool, int]:
    """Sampling parameters, ``stream`` and ``n`` from a request body (BadRequest if invalid;
    ``stream_options`` checked here, read by the handler). Every option is applied by the
    engine's sampler or refused here, never accepted and ignored."""
    for key in _UNSUPPORTED:
        if body.get(key) not in (None, False, 0, [], {}):
            raise BadRequest(f"'{key}' is not supported by this server", param=key)
    fmt = body.get("response_format")
    if fmt not in (None, {}) and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise BadRequest("'response_format' other than {\"type\": \"text\"} is not supported by this server",
                         param="response_format")
    n = _number(body, "n", 1, 1, MAX_CHOICES, integer=True)
    best_of = body.get("best_of")
    if best_of is not None and best_of != n:
        raise BadRequest(f"'best_of' other than n ({n}) is not supported by this server", param="best_of")
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    echo = body.get("echo", False)
    if not isinstance(echo, bool):
        raise BadRequest("'echo' must be a boolean", param="echo")
    if echo and chat:
        raise BadRequest("'echo' is a completions option; chat completions do not support it", param="echo")
    max_tokens = _number(body, key, default_max_tokens if default_max_tokens is not None else context_left,
                         0 if echo else 1, integer=True)
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    if top_p <= 0:
        raise BadRequest("'top_p' must be > 0", param="top_p")
    top_k = _number(body, "top_k", 0, -1, integer=True)  # vLLM's -1 and 0: off
    min_p = _number(body, "min_p", 0.0, 0.0, 1.0)
    presence = _number(body, "presence_penalty", 0.0, -2.0, 2.0)
    frequency = _number(body, "frequency_penalty", 0.0, -2.0, 2.0)
    repetition = _number(body, "repetition_penalty", 1.0, 0.0)
    if repetition <= 0:
        raise BadRequest("'repetition_penalty' must be > 0", param="repetition_penalty")
    min_tokens = _number(body, "min_tokens", 0, 0, integer=True)
    if min_tokens > max_tokens:
        raise BadRequest(f"'min_tokens' ({min_tokens}) must not exceed max_tokens ({max_tokens})", param="min_tokens")
    bias = body.get("logit_bias")
    pairs: list[tuple[int, float]] = []
    if bias is not None:
        if not isinstance(bias, dict):
            raise BadRequest("'logit_bias' must be an object of token id -> bias", param="logit_bias")
        for k, v in bias.items():
            try:
                t = int(k)
            except (TypeError, ValueError):
                raise BadRequest(f"'logit_bias' keys must be token ids, got {json.dumps(k)}",
                                 param="logit_bias") from None
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not -100 <= v <= 100:
                raise BadRequest(f"'logit_bias' values must be numbers in [-100, 100], got {json.dumps(v)}",
                                 param="logit_bias")
            pairs.append((t, float(v)))
    if chat:  # chat: logprobs a boolean, top_logprobs its width
        lp = body.get("logprobs", False)
        if lp is not None and not isinstance(lp, bool):
            raise BadRequest("'logprobs' must be a boolean for chat completions", param="logprobs")
        top = _number(body, "top_logprobs", None, 0, MAX_LOGPROBS, integer=True) \
            if body.get("top_logprobs") is not None else None
        if top is not None and not lp:
            raise BadRequest("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        logprobs = (top or 0) if lp else None
    else:  # completions: logprobs the width (0-20), null for none
        logprobs = _number(body, "logprobs", None, 0, MAX_LOGPROBS, integer=True) \
            if body.get("logprobs") is not None else None
    seed = body.get("seed")
    if seed is None:
        seed = secrets.randbits(32)
    elif isinstance(seed, bool) or not isinstance(seed, int):
        raise BadRequest(f"'seed' must be an integer, got {json.dumps(seed)}", param="seed")
    stop = body.get("stop")
    if stop is None:
        stop = ()
    elif isinstance(stop, str):
        stop = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop) and len(stop) <= 4:
        stop = tuple(stop)
    else:
        raise BadRequest("'stop' must be a string or a list of at most 4 strings", param="stop")
    if any(not s for s in stop):
        raise BadRequest("'stop' strings must not be empty", param="stop")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest(f"'stream' must be a boolean, got {json.dumps(stream)}", param="stream")
    options = body.get("stream_options")
    if options is not None:
        if not stream:
            raise BadRequest("'stream_options' is only allowed with 'stream': true", param="stream_options")
        if not isinstance(options, dict) or set(options) - {"include_usage", "continuous_usage_stats"} \
                or not all(isinstance(v, bool) for v in options.values()):
            raise BadRequest("'stream_options' must be an object of booleans 'include_usage' and "
                             "'continuous_usage_stats'", param="stream_options")
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise BadRequest("'ignore_eos' must be a boolean", param="ignore_eos")
    if max_tokens == 0 and logprobs is None:
        raise BadRequest("'max_tokens' 0 (echo, nothing generated) needs 'logprobs': it scores the prompt",
                         param="max_tokens")
    params = SamplingParams(max_tokens=int(max_tokens), temperature=float(temperature), top_p=float(top_p),
                            seed=int(seed) % 2**32, stop=stop, ignore_eos=ignore_eos, top_k=max(int(top_k), 0),
                            min_p=float(min_p), presence_penalty=float(presence), frequency_penalty=float(frequency),
                            repetition_penalty=float(repetition), min_tokens=int(min_tokens),
                            logit_bias=tuple(pairs), logprobs=logprobs,
                            prompt_logprobs=logprobs if echo and logprobs is not None else None)
    try:
        params.check()
    except ValueError as e:
        raise BadRequest(str(e)) from None
    return params, stream, int(n)


def _prompt_list(prompt: Any, tokenizer) -> list[list[int]]:
    """``prompt`` as a list of prompts' token ids: a string, a list of strings, a list of ids,
    or a list of lists of ids (each a choice of its own, OpenAI's batched completions)."""
    def is_ids(x):
        return isinstance(x, list) and bool(x) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)

    if isinstance(prompt, str):
        return [tokenizer.encode(prompt)]
    if is_ids(prompt):
        return [list(prompt)]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) or is_ids(p) for p in prompt):
        return [tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompt]
    raise BadRequest("'prompt' must be a string, a list of strings, a list of token ids, or a list of lists of "
                     "token ids", param="prompt")


def _chat_text(messages: Any, tokenizer, add_generation_prompt: bool = True) -> str:
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list of {role, content} objects", param="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "developer", "user", "assistant"):
            raise BadRequest(f"messages[{i}] must be an object with a role of system, developer, user or assistant",
                             param="messages")
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise BadRequest(f"messages[{i}].content: only text parts are supported", param="messages")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise BadRequest(f"messages[{i}].content must be a string", param="messages")
        # OpenAI's newer name for the system role (what vLLM does with it too)
        out.append({"role": "system" if m["role"] == "developer" else m["role"], "content": content})
    return tokenizer.apply_chat_template(out, add_generation_prompt=add_generation_prompt)


# -----------------------------------------------------------------------------
# The app
# -----------------------------------------------------------------------------


def build_app(engine: Engine, model_name: str):
    """The FastAPI app serving ``engine`` as model ``model_name`` (the engine must be started)."""
    from fastapi import FastAPI
    from fastapi import Request as HTTPRequest
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException
    from starlette.requests import ClientDisconnect

    if engine.tokenizer is None:
        raise ValueError(f"model {model_name!r} has no tokenizer (random weights): the server needs one")
    tok = engine.tokenizer
    created = int(time.time())
    app = FastAPI(title="sparse-jax", description="OpenAI-compatible serving of sparse-jax models")

    @app.exception_handler(BadRequest)
    async def _bad_request(_, exc: BadRequest):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(http: HTTPRequest, exc: StarletteHTTPException):
        # FastAPI's own 404 / 405 in OpenAI's error shape, as every other refusal
        if exc.status_code == 404:
            msg = f"no route {http.method} {http.url.path} on this server"
        elif exc.status_code == 405:
            msg = f"{http.method} is not allowed on {http.url.path}"
        else:
            msg = str(exc.detail)
        body = BadRequest(msg, status=exc.status_code, code=str(exc.status_code)).body()
        return JSONResponse(body, status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(ClientDisconnect)
    async def _gone(_, exc: ClientDisconnect):
        # The client hung up before its body was read: nothing was submitted and nobody is
        # listening, so no traceback in the log (nginx's 499, "client closed request").
        return Response(status_code=499)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_, exc: RequestValidationError):
        return JSONResponse(BadRequest(f"invalid request: {exc.errors()}").body(), status_code=400)

    @app.get("/health")
    async def health():
        s = engine.stats()
        ok = engine.error is None and s["alive"]
        return JSONResponse({"status": "ok" if ok else "error", **s}, status_code=200 if ok else 503)

    def model_card() -> dict:
        return {"id": model_name, "object": "model", "created": created, "owned_by": "sparse-jax",
                "max_model_len": engine.context}

    metrics = ServerMetrics(engine, model_name)

    @app.get("/metrics")
    async def prometheus_metrics():
        """Prometheus text (:mod:`models.serving.metrics`)."""
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str):
        if model_id != model_name:
            raise BadRequest(f"The model '{model_id}' does not exist; this server serves '{model_name}'",
                             status=404, param="model", code="model_not_found")
        return model_card()

    @app.get("/ping")
    async def ping():
        ok = engine.error is None and engine.stats()["alive"]
        return JSONResponse({}, status_code=200 if ok else 503)

    app.post("/ping", operation_id="ping_post")(ping)

    @app.get("/version")
    async def version():
        return {"version": sparse_jax.__version__}

    async def _json_object(http: HTTPRequest, require_model: bool = False) -> dict:
        """The body as a JSON object (BadRequest otherwise); its ``model``, required or
        optional (the tokenizer endpoints), must be this server's."""
        raw = await http.body()
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise BadRequest(f"the request body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise BadRequest("the request body must be a JSON object")
        model = body.get("model")
        if require_model and not isinstance(model, str):
            raise BadRequest("'model' is required (a string)", param="model")
        if model is not None and model != model_name:
            raise BadRequest(f"The model '{model}' does not exist; this server serves '{model_name}'",
                             status=404, param="model", code="model_not_found")
        return body

    @app.post("/tokenize", openapi_extra=_body_schema(TOKENIZE_BODY, model_name))
    async def tokenize(http: HTTPRequest):
        """vLLM's ``/tokenize``: ``prompt`` (text) or ``messages`` (rendered with the chat
        template; ``add_generation_prompt``, default true) to ``tokens``, ``count`` and
        ``max_model_len``; ``return_token_strs`` adds each token's string."""
        body = await _json_object(http)
        if ("prompt" in body) == ("messages" in body):
            raise BadRequest("give exactly one of 'prompt' (a string) or 'messages'", param="prompt")
        if "prompt" in body:
            if not isinstance(body["prompt"], str):
                raise BadRequest("'prompt' must be a string", param="prompt")
            text = body["prompt"]
        else:
            gen = body.get("add_generation_prompt", True)
            if not isinstance(gen, bool):
                raise BadRequest("'add_generation_prompt' must be a boolean", param="add_generation_prompt")
            text = _chat_text(body["messages"], tok, add_generation_prompt=gen)
        special = body.get("add_special_tokens", True)
        if not isinstance(special, bool):
            raise BadRequest("'add_special_tokens' must be a boolean", param="add_special_tokens")
        ids = tok.encode(text)
        if not special and tok.add_bos and ids and ids[0] == tok.bos_token_id:
            ids = ids[1:]
        out = {"count": len(ids), "max_model_len": engine.context, "tokens": ids}
        strs = body.get("return_token_strs", False)
        if not isinstance(strs, bool):
            raise BadRequest("'return_token_strs' must be a boolean", param="return_token_strs")
        if strs:
            out["token_strs"] = [tok.id_to_token(i) for i in ids]
        return out

    @app.post("/detokenize", openapi_extra=_body_schema(DETOKENIZE_BODY, model_name))
    async def detokenize(http: HTTPRequest):
        """vLLM's ``/detokenize``: ``tokens`` (ids) to ``prompt`` (their text)."""
        body = await _json_object(http)
        ids = body.get("tokens")
        vocab = engine.model.config.vocab_size
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab
                                                for t in ids):
            raise BadRequest(f"'tokens' must be a list of token ids in [0, {vocab})", param="tokens")
        return {"prompt": tok.decode(ids)}

    async def _body(http: HTTPRequest) -> dict:
        """A completions body: a JSON object naming this server's model."""
        return await _json_object(http, require_model=True)

    def _request(ids: list[int], params: SamplingParams, on_event, group=None) -> Request:
        try:
            return engine.make_request(ids, params, on_event, prefill_group=group)
        except ValueError as e:
            raise BadRequest(str(e), code="context_length_exceeded" if "context" in str(e) else None) from None

    def token_text(i: int) -> str:
        return tok.decode([i])

    def completion_logprobs(ids: list[int], entries: list, offset: int = 0) -> dict:
        """OpenAI's completions ``logprobs``: per token its text, log-probability (None for a
        prompt's first), the top tokens' (with the token itself, as vLLM) and its offset in
        the returned text."""
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for i, e in zip(ids, entries):
            text = token_text(i)
            out["tokens"].append(text)
            out["text_offset"].append(offset)
            offset += len(text)
            if e is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
            else:
                top = {token_text(t): v for t, v in e.top}
                top.setdefault(text, e.logprob)
                out["token_logprobs"].append(e.logprob)
                out["top_logprobs"].append(top)
        return out

    def chat_logprobs(entries: list) -> dict:
        """OpenAI's chat ``logprobs``: ``content``, per token its text, bytes, log-probability
        and ``top_logprobs``."""
        def one(t: int, v: float) -> dict:
            text = token_text(t)
            return {"token": text, "logprob": v, "bytes": list(text.encode("utf-8"))}

        return {"content": [{**one(e.token_id, e.logprob), "top_logprobs": [one(t, v) for t, v in e.top]}
                            for e in entries]}

    async def _run(http: HTTPRequest, prompts: list[list[int]], params: SamplingParams, n: int, stream: bool,
                   chat: bool, stream_options: dict | None = None, echo: bool = False):
        """Serve ``n`` choices of each prompt (choice ``index = prompt * n + j``, sample ``j``
        drawing from ``seed + j``), each a request of the engine, as one response."""
        if engine.error is not None:
            raise BadRequest(f"the engine stopped after an error: {engine.error!r}", status=503,
                             type_="server_error")
        if len(prompts) * n > MAX_CHOICES:
            raise BadRequest(f"{len(prompts)} prompts x n={n} = {len(prompts) * n} choices; at most {MAX_CHOICES}",
                             param="n")
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()
        echo_text = echo and not chat  # completions' echo: the prompt's text before the output
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{secrets.token_hex(12)}"
        reqs: list[Request] = []
        for k, ids in enumerate(prompts):  # every request checked before any is submitted
            for j in range(n):
                index = len(reqs)
                p = params if j == 0 else dataclasses.replace(params, seed=(params.seed + j) % 2**32)
                # a prompt's n choices share one prefill when admitted together
                reqs.append(_request(ids, p, lambda ev, i=index: loop.call_soon_threadsafe(events.put_nowait, (i, ev)),
                                     group=(rid, k) if n > 1 else None))
        engine.submit_all(reqs)

        def cancel_all():
            for r in reqs:
                if r.finish_reason is None:
                    engine.cancel(r)

        def usage():
            prompt = sum(len(ids) for ids in prompts)  # a prompt counts once, whatever n
            done = sum(len(r.output_ids) for r in reqs)
            return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}

        def prompt_text(r: Request) -> str:
            return tok.decode(r.prompt_ids)

        if not stream:
            pending = len(reqs)
            try:
                while pending:
                    try:
                        _, ev = await asyncio.wait_for(events.get(), 0.5)
                    except asyncio.TimeoutError:
                        if await http.is_disconnected():
                            cancel_all()
                            return JSONResponse({}, status_code=499)
                        continue
                    pending -= ev.kind == "done"
            except BaseException:
                cancel_all()
                raise
            failed = [r for r in reqs if r.finish_reason == "error"]
            if failed:
                raise BadRequest(failed[0].error or "the request failed", status=500, type_="server_error")
            choices = []
            for i, r in enumerate(reqs):
                if chat:
                    lp = chat_logprobs(r.logprobs) if r.params.logprobs is not None else None
                    choices.append({"index": i, "message": {"role": "assistant", "content": r.text},
                                    "finish_reason": r.finish_reason, "logprobs": lp})
                    continue
                head = prompt_text(r) if echo_text else ""
                lp = None
                if r.params.logprobs is not None:
                    ids, entries = r.output_ids, r.logprobs
                    if r.prompt_logprobs is not None:
                        ids, entries = r.prompt_ids + ids, r.prompt_logprobs + entries
                    lp = completion_logprobs(ids, entries)
                choices.append({"index": i, "text": head + r.text, "finish_reason": r.finish_reason, "logprobs": lp})
            return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                    "model": model_name, "choices": choices, "usage": usage()}

        # OpenAI's stream_options.include_usage: a last chunk with no choices and the usage (every
        # other chunk's usage null); vLLM's continuous_usage_stats: the usage so far in every chunk
        include_usage = bool((stream_options or {}).get("include_usage"))
        continuous = include_usage and bool((stream_options or {}).get("continuous_usage_stats"))
        offsets = [0] * len(reqs)  # completions: each choice's text so far (logprobs' text_offset)
        held: list[list[TokenLogprob]] = [[] for _ in reqs]  # logprobs of tokens whose text is not sent yet
        held_ids: list[list[int]] = [[] for _ in reqs]

        def frame(choices: list, usage_now=None) -> str:
            out = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                   "created": int(time.time()), "model": model_name, "choices": choices}
            if include_usage:
                out["usage"] = usage_now
            return "data: " + json.dumps(out) + "\n\n"

        def chunk(i: int, text: str | None, finish: str | None, first: bool = False) -> str:
            r = reqs[i]
            lp = None
            if r.params.logprobs is not None and (held[i] or finish is not None):
                if chat:
                    lp = chat_logprobs(held[i])
                else:
                    lp = completion_logprobs(held_ids[i], held[i], offsets[i])
                held[i], held_ids[i] = [], []
            if chat:
                delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text else {})
                choice = {"index": i, "delta": delta, "finish_reason": finish, "logprobs": lp}
            else:
                choice = {"index": i, "text": text or "", "finish_reason": finish, "logprobs": lp}
                offsets[i] += len(text or "")
            return frame([choice], usage() if continuous else None)

        async def sse():
            try:
                for i, r in enumerate(reqs):
                    if chat:
                        yield chunk(i, None, None, first=True)
                    elif echo_text:  # the prompt first, with its logprobs when asked
                        if r.params.logprobs is not None:
                            while r.prompt_logprobs is None and r.finish_reason is None:
                                await asyncio.sleep(0.005)  # scored on the engine's thread, before it decodes
                            if r.prompt_logprobs is not None:
                                held[i], held_ids[i] = list(r.prompt_logprobs), list(r.prompt_ids)
                        yield chunk(i, prompt_text(r), None)
                pending = len(reqs)
                while pending:
                    i, ev = await events.get()
                    r = reqs[i]
                    held[i].extend(ev.logprobs)
                    held_ids[i].extend(ev.token_ids[:len(ev.logprobs)])
                    if ev.kind == "done":
                        pending -= 1
                        if r.finish_reason == "error":
                            # OpenAI's stream error shape: the official client raises it as an APIError
                            yield "data: " + json.dumps(BadRequest(r.error or "the request failed", status=500,
                                                                   type_="server_error").body()) + "\n\n"
                            cancel_all()
                            break
                        if ev.text:
                            yield chunk(i, ev.text, None)
                        yield chunk(i, None, r.finish_reason)
                        continue
                    if ev.text:
                        yield chunk(i, ev.text, None)
                if include_usage:
                    yield frame([], usage())
                yield "data: [DONE]\n\n"
            finally:
                # a client that went away (the generator is closed or cancelled) frees its slots
                cancel_all()

        return StreamingResponse(sse(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    @app.post("/v1/completions", openapi_extra=_body_schema(COMPLETIONS_BODY, model_name))
    async def completions(http: HTTPRequest):
        body = await _body(http)
        if "prompt" not in body:
            raise BadRequest("'prompt' is required", param="prompt")
        prompts = _prompt_list(body["prompt"], tok)
        params, stream, n = _common_params(body, 16, max(1, engine.context - max(len(p) for p in prompts)))
        return await _run(http, prompts, params, n, stream, chat=False, stream_options=body.get("stream_options"),
                          echo=bool(body.get("echo")))

    @app.post("/v1/chat/completions", openapi_extra=_body_schema(CHAT_BODY, model_name))
    async def chat_completions(http: HTTPRequest):
        body = await _body(http)
        ids = tok.encode(_chat_text(body.get("messages"), tok))
        params, stream, n = _common_params(body, None, max(1, engine.context - len(ids)), chat=True)
        return await _run(http, [ids], params, n, stream, chat=True, stream_options=body.get("stream_options"))

    return app


# -----------------------------------------------------------------------------
# Running the app in-process
# -----------------------------------------------------------------------------


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now (the OS picks it)."""
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve_in_thread(engine: Engine, model_name: str, *, startup_timeout: float = 60.0):
    """``engine`` (started) behind the app on a uvicorn thread on a free loopback port, for
    tests and in-process clients: yields the base URL; on exit stops the server, then the
    engine. RuntimeError if uvicorn does not start within ``startup_timeout`` seconds."""
    import threading

    import uvicorn

    srv = uvicorn.Server(uvicorn.Config(build_app(engine, model_name), host="127.0.0.1", port=free_port(),
                                        log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    try:
        end = time.time() + startup_timeout
        while not srv.started:
            if time.time() > end or not thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        yield f"http://127.0.0.1:{srv.config.port}"
    finally:
        srv.should_exit = True
        thread.join(10)
        engine.stop()
