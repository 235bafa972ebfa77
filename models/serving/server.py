"""An OpenAI-compatible HTTP server over the engine (:mod:`models.serving.engine`).

::

    python -m models.serve --model smollm2-135m --attention quest --port 8000
    curl localhost:8000/v1/completions -H 'Content-Type: application/json' \\
         -d '{"model": "smollm2-135m", "prompt": "The capital of France is", "max_tokens": 16}'

Endpoints: ``POST /v1/completions`` and ``POST /v1/chat/completions`` (``stream``:
server-sent events, else one JSON body; ``stream_options.include_usage`` and vLLM's
``continuous_usage_stats``), ``GET /v1/models`` and ``/v1/models/{id}``, ``GET /health``
(the engine's counters), ``/ping``, ``/version``, and vLLM's ``POST /tokenize`` /
``/detokenize``. FastAPI on uvicorn; the engine runs in its own thread
and each request talks to it through an asyncio queue fed with
``loop.call_soon_threadsafe``.

Bad input gets a 4xx in OpenAI's error shape (``{"error": {"message", "type",
"param", "code"}}``) before any device work: malformed JSON or fields (400),
an unknown model (404), a prompt over the context or ``max_tokens`` past it
(400), unsupported options (``n`` > 1, ``logprobs``, ``echo``, ...: 400; sampling options
the sampler does not apply yet, such as ``top_k`` or the penalties, are refused unless at
their neutral value, never accepted and ignored), an unknown route (404) or method (405). A
client that disconnects cancels its request, which frees its slot.

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
import json
import secrets
import time
from typing import Any

import sparse_jax
from models.serving.engine import Engine
from models.serving.requests import Event, Request, SamplingParams

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


_UNSUPPORTED = ("logprobs", "top_logprobs", "echo", "best_of", "suffix", "tools", "functions", "logit_bias",
                "tool_choice", "function_call")

#: sampling options the engine's sampler does not apply yet, and the value at which each does nothing:
#: refused unless neutral (an option accepted and ignored would change nothing the client asked for)
_NEUTRAL = {"frequency_penalty": 0, "presence_penalty": 0, "repetition_penalty": 1, "top_k": (-1, 0),
            "min_p": 0, "min_tokens": 0}


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


def _common_params(body: dict, default_max_tokens: int | None, context_left: int) -> tuple[SamplingParams, bool]:
    """Sampling parameters and ``stream`` from a request body (BadRequest if invalid;
    ``stream_options`` checked here, read by the handler)."""
    for key in _UNSUPPORTED:
        if body.get(key) not in (None, False, 0, [], {}):
            raise BadRequest(f"'{key}' is not supported by this server", param=key)
    for key, neutral in _NEUTRAL.items():
        v = body.get(key)
        if v is not None and v not in (neutral if isinstance(neutral, tuple) else (neutral,)):
            raise BadRequest(f"'{key}' is not applied by this server's sampler yet: leave it out or at its "
                             f"default ({neutral if not isinstance(neutral, tuple) else neutral[0]})", param=key)
    fmt = body.get("response_format")
    if fmt not in (None, {}) and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise BadRequest("'response_format' other than {\"type\": \"text\"} is not supported by this server",
                         param="response_format")
    n = _number(body, "n", 1, 1, integer=True)
    if n != 1:
        raise BadRequest(f"'n' must be 1 (one choice per request), got {n}", param="n")
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _number(body, key, default_max_tokens if default_max_tokens is not None else context_left,
                         1, integer=True)
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    if top_p <= 0:
        raise BadRequest("'top_p' must be > 0", param="top_p")
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
    return SamplingParams(max_tokens=int(max_tokens), temperature=float(temperature), top_p=float(top_p),
                          seed=int(seed) % 2**32, stop=stop, ignore_eos=ignore_eos), stream


def _prompt_ids(prompt: Any, tokenizer) -> list[int]:
    """``prompt`` as token ids: a string, a one-element list of strings, or a list of ids."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return tokenizer.encode(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt)
    raise BadRequest("'prompt' must be a string, a list of one string, or a list of token ids "
                     "(one prompt per request)", param="prompt")


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
    from fastapi.responses import JSONResponse, StreamingResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

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

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str):
        if model_id != model_name:
            raise BadRequest(f"The model '{model_id}' does not exist; this server serves '{model_name}'",
                             status=404, param="model", code="model_not_found")
        return model_card()

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping():
        ok = engine.error is None and engine.stats()["alive"]
        return JSONResponse({}, status_code=200 if ok else 503)

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

    @app.post("/tokenize")
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

    @app.post("/detokenize")
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

    def _request(ids: list[int], params: SamplingParams, on_event) -> Request:
        try:
            return engine.make_request(ids, params, on_event)
        except ValueError as e:
            raise BadRequest(str(e), code="context_length_exceeded" if "context" in str(e) else None) from None

    async def _run(http: HTTPRequest, ids: list[int], params: SamplingParams, stream: bool, chat: bool,
                   stream_options: dict | None = None):
        if engine.error is not None:
            raise BadRequest(f"the engine stopped after an error: {engine.error!r}", status=503,
                             type_="server_error")
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Event] = asyncio.Queue()
        req = _request(ids, params, lambda ev: loop.call_soon_threadsafe(events.put_nowait, ev))
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{secrets.token_hex(12)}"
        engine.submit(req)

        def usage():
            return {"prompt_tokens": req.prompt_len, "completion_tokens": len(req.output_ids),
                    "total_tokens": req.prompt_len + len(req.output_ids)}

        if not stream:
            try:
                while True:
                    try:
                        ev = await asyncio.wait_for(events.get(), 0.5)
                    except asyncio.TimeoutError:
                        if await http.is_disconnected():
                            engine.cancel(req)
                            return JSONResponse({}, status_code=499)
                        continue
                    if ev.kind == "done":
                        break
            except BaseException:
                engine.cancel(req)
                raise
            if req.finish_reason == "error":
                raise BadRequest(req.error or "the request failed", status=500, type_="server_error")
            choice = ({"index": 0, "message": {"role": "assistant", "content": req.text},
                       "finish_reason": req.finish_reason, "logprobs": None} if chat else
                      {"index": 0, "text": req.text, "finish_reason": req.finish_reason, "logprobs": None})
            return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                    "model": model_name, "choices": [choice], "usage": usage()}

        # OpenAI's stream_options.include_usage: a last chunk with no choices and the usage (every
        # other chunk's usage null); vLLM's continuous_usage_stats: the usage so far in every chunk
        include_usage = bool((stream_options or {}).get("include_usage"))
        continuous = include_usage and bool((stream_options or {}).get("continuous_usage_stats"))

        def frame(choices: list, usage_now=None) -> str:
            out = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                   "created": int(time.time()), "model": model_name, "choices": choices}
            if include_usage:
                out["usage"] = usage_now
            return "data: " + json.dumps(out) + "\n\n"

        def chunk(text: str | None, finish: str | None, first: bool = False) -> str:
            if chat:
                delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text else {})
                choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
            else:
                choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
            return frame([choice], usage() if continuous else None)

        async def sse():
            try:
                if chat:
                    yield chunk(None, None, first=True)
                while True:
                    ev = await events.get()
                    if ev.kind == "done":
                        if req.finish_reason == "error":
                            # OpenAI's stream error shape: the official client raises it as an APIError
                            yield "data: " + json.dumps(BadRequest(req.error or "the request failed", status=500,
                                                                   type_="server_error").body()) + "\n\n"
                            break
                        if ev.text:
                            yield chunk(ev.text, None)
                        yield chunk(None, req.finish_reason)
                        if include_usage:
                            yield frame([], usage())
                        break
                    if ev.text:
                        yield chunk(ev.text, None)
                yield "data: [DONE]\n\n"
            finally:
                # a client that went away (the generator is closed or cancelled) frees its slot
                if req.finish_reason is None:
                    engine.cancel(req)

        return StreamingResponse(sse(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    @app.post("/v1/completions")
    async def completions(http: HTTPRequest):
        body = await _body(http)
        if "prompt" not in body:
            raise BadRequest("'prompt' is required", param="prompt")
        ids = _prompt_ids(body["prompt"], tok)
        params, stream = _common_params(body, 16, max(1, engine.context - len(ids)))
        return await _run(http, ids, params, stream, chat=False, stream_options=body.get("stream_options"))

    @app.post("/v1/chat/completions")
    async def chat_completions(http: HTTPRequest):
        body = await _body(http)
        ids = tok.encode(_chat_text(body.get("messages"), tok))
        params, stream = _common_params(body, None, max(1, engine.context - len(ids)))
        return await _run(http, ids, params, stream, chat=True, stream_options=body.get("stream_options"))

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
