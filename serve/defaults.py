"""Server limits shared by the CLI and the app (kept apart so the CLI can build its
parser without importing the web stack)."""

DEFAULT_MAX_WAITING_REQUESTS = 1024
DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024  # a 128k-token prompt as text is well under this
DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0
