"""The server's gate, before any body is parsed: request bodies over the limit (413), and bearer keys — the client
keys on /v1 and the API documents, the admin key on /admin (401, 404 when the admin API is off) — compared in
constant time. Which client key a request came with goes into its scope (`specwise_key`): its suffix-history tenant.
"""

from __future__ import annotations

import hmac
import json

from specwise.server.protocol import error_body

DOC_PATHS = ("/docs", "/redoc", "/openapi.json")  # behind the API key too: they describe what a key opens


def key_index(auth: str, keys: tuple[str, ...]) -> int | None:
    """Which of `keys` the Authorization header carries, compared in constant time (every key, every time)."""
    found = None
    given = auth.encode("utf-8", "replace")
    for i, key in enumerate(keys):
        if hmac.compare_digest(given, f"Bearer {key}".encode()) and found is None:
            found = i
    return found


LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def host_name(header: str) -> str:
    """The host of a Host header, without its port ('[::1]:8000' → '::1', 'a.b:80' → 'a.b'), lowercased."""
    h = header.strip().lower()
    if h.startswith("["):
        return h[1 : h.find("]")] if "]" in h else h
    return h.rsplit(":", 1)[0] if h.count(":") == 1 else h


class BodyLimit:
    """ASGI middleware: refuse request bodies over `limit` bytes (413) and check the bearer token on /v1 and the
    API documents (401); the index of the key a request came with goes into its scope (`specwise_key`)."""

    def __init__(
        self,
        app,
        limit: int,
        api_keys: tuple[str, ...],
        admin_key: str | None = None,
        allowed_hosts: tuple[str, ...] | None = None,
    ):
        self.app, self.limit, self.api_keys, self.admin_key = app, limit, api_keys, admin_key
        self.allowed_hosts = None if allowed_hosts is None else {h.lower() for h in allowed_hosts}

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        path = scope["path"]
        if self.allowed_hosts is not None:  # a page that rebinds its DNS name to loopback reaches no keyless server
            host = host_name(headers.get("host", ""))
            if host not in self.allowed_hosts:
                return await send_error(
                    send,
                    421,
                    f"the Host header {host!r:.80} is not one this server answers to: allowed "
                    f"{sorted(self.allowed_hosts)} (serve --allowed-hosts)",
                    "invalid_request_error",
                    "host_not_allowed",
                )
        if self.api_keys and (path.startswith("/v1") or path.startswith(DOC_PATHS)):
            auth = headers.get("authorization", "")
            index = key_index(auth, self.api_keys)
            if index is None:
                why = "no API key given" if not auth else "the API key is wrong"
                return await send_error(
                    send, 401, f"{why}: send 'Authorization: Bearer <key>'", "invalid_request_error", "invalid_api_key"
                )
            scope["specwise_key"] = f"key-{index}"
        if path.startswith("/admin"):
            auth = headers.get("authorization", "")
            if not self.admin_key:
                return await send_error(
                    send,
                    404,
                    "the admin API is off: start the server with --admin-key",
                    "invalid_request_error",
                    "admin_disabled",
                )
            if key_index(auth, (self.admin_key,)) is None:
                why = (
                    "that is the client API key; the admin API takes the --admin-key"
                    if key_index(auth, self.api_keys) is not None
                    else ("no admin key given" if not auth else "the admin key is wrong")
                )
                return await send_error(
                    send,
                    401,
                    f"{why}: send 'Authorization: Bearer <admin key>'",
                    "invalid_request_error",
                    "invalid_admin_key",
                )
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.limit:
            return await send_error(
                send,
                413,
                f"the request body is {declared} bytes; at most {self.limit} are allowed",
                "invalid_request_error",
                "request_too_large",
            )
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        body, more = b"", True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.limit:
                return await send_error(
                    send,
                    413,
                    f"the request body is over {self.limit} bytes, the most allowed",
                    "invalid_request_error",
                    "request_too_large",
                )
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)


async def send_error(send, status: int, message: str, type_: str, code: str) -> None:

    payload = json.dumps(error_body(message, type_, None, code)).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": payload})
