"""API keys, as vLLM's `--api-key` does: with keys set, every endpoint but `/health` needs
`Authorization: Bearer <key>` (what the official `openai` client sends for `api_key=<key>`); anything else is a
401 in OpenAI's error shape. Keys come from `--api-key` (repeatable) and `ASR_SPEC_API_KEY` (comma-separated).

A WebSocket (`/v1/realtime`) without a valid key is refused before it opens (HTTP 403). A browser cannot set
headers on a WebSocket, so there the key may also come as the subprotocol `openai-insecure-api-key.<key>` (what
OpenAI's browser clients send); the page at `/` and its files are open (they hold no data: the page asks for the
key and sends it so).
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import os
from collections.abc import Iterable
from typing import Any

from starlette.responses import JSONResponse

from asr_spec.errors import InputError
from asr_spec.serve.responses import error_body

__all__ = ["API_KEY_ENV", "OPEN_PATHS", "ApiKeyMiddleware", "api_keys", "warn_if_exposed"]

log = logging.getLogger(__name__)
API_KEY_ENV = "ASR_SPEC_API_KEY"
OPEN_PATHS = frozenset({"/health", "/"})  # answered without a key (a load balancer's probe; the page)
OPEN_PREFIXES = ("/static/",)  # the page's files
KEY_SUBPROTOCOL = "openai-insecure-api-key."  # a WebSocket subprotocol carrying the key (browsers)


def api_keys(keys: Iterable[str] | None = None, environ: dict[str, str] | None = None) -> tuple[str, ...]:
    """The keys given plus those of `ASR_SPEC_API_KEY` (comma-separated), without blanks; an empty key given
    explicitly is an `InputError`."""
    given = list(keys or ())
    if any(not key.strip() for key in given):
        raise InputError("api_key must not be empty")
    env = (os.environ if environ is None else environ).get(API_KEY_ENV, "")
    found = [key.strip() for key in given] + [key.strip() for key in env.split(",") if key.strip()]
    return tuple(dict.fromkeys(found))


def warn_if_exposed(host: str, keys: tuple[str, ...]) -> None:
    """Warn once when the server listens beyond this machine with no key."""
    if keys or _is_loopback(host):
        return
    log.warning("serving on %s without an API key: anyone who can reach the port can use it (set --api-key or "
                "%s)", host, API_KEY_ENV)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


class ApiKeyMiddleware:
    """ASGI middleware refusing HTTP requests without a valid bearer key (401), except on `OPEN_PATHS`."""

    def __init__(self, app: Any, keys: tuple[str, ...]):
        self.app = app
        self.keys = tuple(key.encode() for key in keys)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        path = scope.get("path", "")
        open_path = path in OPEN_PATHS or path.startswith(OPEN_PREFIXES)
        if scope["type"] not in ("http", "websocket") or open_path or self._allowed(scope):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        body = error_body(401, "missing or invalid API key: send `Authorization: Bearer <key>`", None,
                          "invalid_api_key")
        response = JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)

    def _allowed(self, scope: dict[str, Any]) -> bool:
        header = dict(scope.get("headers") or ()).get(b"authorization", b"")
        scheme, _, token = header.partition(b" ")
        tokens = [token.strip()] if scheme.lower() == b"bearer" else []
        if scope["type"] == "websocket":
            prefix = KEY_SUBPROTOCOL
            tokens += [p[len(prefix):].encode() for p in scope.get("subprotocols", ()) if p.startswith(prefix)]
        return any(hmac.compare_digest(token, key) for token in tokens for key in self.keys)  # no timing leak
