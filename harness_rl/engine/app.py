"""The engine's aiohttp application: vLLM's OpenAI-compatible surface plus its control routes.

Every response, JSON or SSE, carries `x-policy-version: <int>`: for a generation, the weight
version it started under; for anything else, the engine's current version.
"""

import logging

from aiohttp import web

from harness_rl import __version__
from harness_rl.engine.chat_render import render_chat
from harness_rl.engine.chat_route import chat_completions
from harness_rl.engine.completions_route import completions
from harness_rl.engine.control_routes import add_control_routes
from harness_rl.engine.derender_route import derender_chat_completion
from harness_rl.engine.engine import Engine
from harness_rl.engine.errors import ApiError
from harness_rl.engine.forced import ForcedCompletions
from harness_rl.engine.generate_route import abort_requests, generate
from harness_rl.engine.protocol import DetokenizeRequest, ForcedScript, TokenizeRequest, decode_body
from harness_rl.engine.render_route import render_chat_completion
from harness_rl.engine.request_params import check_model
from harness_rl.engine.server_context import CONTEXT, ServerContext
from harness_rl.wire import MODELS_ROUTE, POLICY_VERSION_HEADER

MAX_BODY_BYTES = 8 * 1024**3
logger = logging.getLogger(__name__)


@web.middleware
async def _errors(request: web.Request, handler) -> web.StreamResponse:
    """Refusals and unknown routes in OpenAI's error shape."""
    try:
        return await handler(request)
    except ApiError as error:
        return error.response()
    except web.HTTPException as error:
        if error.status < 400:
            raise
        return ApiError(error.status, error.reason or "error").response()
    except ConnectionResetError:  # the client left mid-stream; its generation is already aborted
        raise
    except Exception as error:  # a bug must still answer in the error shape, and be logged
        logger.exception("unhandled error on %s %s", request.method, request.path)
        return ApiError(500, f"Internal error: {type(error).__name__}: {error}").response()


async def _stamp_version(request: web.Request, response: web.StreamResponse) -> None:
    if POLICY_VERSION_HEADER not in response.headers:
        response.headers[POLICY_VERSION_HEADER] = str(request.app[CONTEXT].engine.policy_version)


async def tokenize(request: web.Request) -> web.Response:
    engine = request.app[CONTEXT].engine
    body = decode_body(await request.read(), TokenizeRequest)
    check_model(body.model, engine.served_model_name)
    if body.messages is not None:
        tokens = render_chat(
            engine.tokenizer,
            body.messages,
            tools=body.tools,
            add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message,
            chat_template_kwargs=body.chat_template_kwargs,
        )
    elif body.prompt is not None:
        add_special = True if body.add_special_tokens is None else body.add_special_tokens
        tokens = engine.tokenizer.encode(body.prompt, add_special_tokens=add_special)
    else:
        raise ApiError(400, "Send either `prompt` (text) or `messages` (chat).")
    strings = engine.tokenizer.convert_ids_to_tokens(tokens) if body.return_token_strs else None
    return web.json_response(
        {"count": len(tokens), "max_model_len": engine.max_model_len, "tokens": tokens, "token_strs": strings}
    )


async def detokenize(request: web.Request) -> web.Response:
    engine = request.app[CONTEXT].engine
    body = decode_body(await request.read(), DetokenizeRequest)
    check_model(body.model, engine.served_model_name)
    vocab = len(engine.tokenizer)
    bad = [t for t in body.tokens if not 0 <= t < vocab]
    if bad:
        raise ApiError(400, f"Token id {bad[0]} is out of vocabulary (size {vocab}).", param="tokens")
    return web.json_response({"prompt": engine.tokenizer.decode(body.tokens)})


async def models(request: web.Request) -> web.Response:
    ctx = request.app[CONTEXT]
    name = ctx.engine.served_model_name
    card = {
        "id": name,
        "object": "model",
        "created": ctx.created,
        "owned_by": "harness-rl",
        "root": ctx.engine.model_root,
        "parent": None,
        "max_model_len": ctx.engine.max_model_len,
        "vocab_size": ctx.engine.vocab_size,
        "permission": [
            {
                "id": f"modelperm-{name}",
                "object": "model_permission",
                "created": ctx.created,
                "allow_create_engine": False,
                "allow_sampling": True,
                "allow_logprobs": True,
                "allow_search_indices": False,
                "allow_view": True,
                "allow_fine_tuning": False,
                "organization": "*",
                "group": None,
                "is_blocking": False,
            }
        ],
    }
    return web.json_response({"object": "list", "data": [card]})


async def _abort_generations(app: web.Application) -> None:
    """A stopping server ends its generations at once, so handlers answer instead of holding the shutdown."""
    app[CONTEXT].engine.abort_all()


async def health(request: web.Request) -> web.Response:
    return web.Response(status=200)


async def version(request: web.Request) -> web.Response:
    return web.json_response({"version": f"harness-rl-{__version__}"})


def _forced(request: web.Request) -> ForcedCompletions:
    forced = request.app[CONTEXT].forced
    assert forced is not None, "the forced-completion routes exist only when forced completions are enabled"
    return forced


async def forced_add(request: web.Request) -> web.Response:
    script = decode_body(await request.read(), ForcedScript)
    forced = _forced(request)
    forced.extend(script.tools, script.no_tools)
    return web.json_response(forced.remaining())


async def forced_show(request: web.Request) -> web.Response:
    return web.json_response(_forced(request).remaining())


async def forced_clear(request: web.Request) -> web.Response:
    forced = _forced(request)
    forced.clear()
    return web.json_response(forced.remaining())


def create_app(
    engine: Engine, *, forced_completions: bool = False, return_tokens_as_token_ids: bool = False
) -> web.Application:
    """The HTTP face of `engine`. Forced completions exist only when asked for here."""
    app = web.Application(middlewares=[_errors], client_max_size=MAX_BODY_BYTES)
    app[CONTEXT] = ServerContext(
        engine=engine,
        forced=ForcedCompletions() if forced_completions else None,
        tokens_as_ids=return_tokens_as_token_ids,
    )
    app.on_response_prepare.append(_stamp_version)
    app.on_shutdown.append(_abort_generations)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions/render", render_chat_completion)
    app.router.add_post("/inference/v1/generate", generate)
    app.router.add_post("/v1/chat/completions/derender", derender_chat_completion)
    app.router.add_post("/inference/v1/abort_requests", abort_requests)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get(MODELS_ROUTE, models)
    app.router.add_get("/health", health)
    app.router.add_get("/version", version)
    add_control_routes(app)
    if forced_completions:
        app.router.add_post("/forced_completions", forced_add)
        app.router.add_get("/forced_completions", forced_show)
        app.router.add_delete("/forced_completions", forced_clear)
    return app
