"""GET /: the server's web chat page, one static HTML file (static/chat.html: inline CSS and JS, no external
URL, so it works offline) that talks to the server's own API: /v1/models for the model's name, and
/v1/chat/completions streamed (server-sent events read from fetch's body) for each reply.

The page itself is served without the API key (server.OPEN_PATHS): a browser opening the URL cannot send an
Authorization header, and the page holds no data, only the code that asks for the key and then sends it as
`Authorization: Bearer KEY` on every API call it makes, which the key still guards."""
from __future__ import annotations

from importlib.resources import files

from starlette.requests import Request
from starlette.responses import HTMLResponse
from starlette.routing import Route

PAGE = files(__package__).joinpath("static", "chat.html")


async def chat_page(request: Request) -> HTMLResponse:
    # Read on each request (a few kB): an edited page shows on reload, without restarting the server.
    return HTMLResponse(PAGE.read_text(encoding="utf-8"), headers={"Cache-Control": "no-cache"})


def route() -> Route:
    """The route that Server.app() lists: GET (and HEAD) / answers the page."""
    return Route("/", chat_page, methods=["GET"])
