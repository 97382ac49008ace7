"""Server limits shared by the CLI and the app (kept apart so the CLI can build its
parser without importing the web stack)."""

DEFAULT_MAX_WAITING_REQUESTS = 1024
DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024  # a 128k-token prompt as text is well under this
DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0
# An idle HTTP/1.1 connection stays open this long. Above the idle expiry of common clients (httpx 5 s,
# aiohttp 15 s), so a client never sends a request on a connection the server is closing at that moment
# (uvicorn's own 5 s equals httpx's: the request then fails with a connection reset).
DEFAULT_KEEP_ALIVE_S = 20.0
# Clients of this package (the router, `jlight bench serve`) drop idle connections sooner than any
# server's keep-alive they meet (uvicorn's default, vLLM's and SGLang's: 5 s).
CLIENT_KEEPALIVE_EXPIRY_S = 2.0
