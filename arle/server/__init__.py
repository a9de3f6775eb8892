"""The OpenAI-compatible HTTP server: app.py (routes), protocol.py (wire format), metrics.py.

NOTE: nothing is imported here: `arle serve --help` reads the constant below without loading
starlette or pydantic.
"""

#: Default request body limit: a whole context of text is far below it.
DEFAULT_MAX_BODY_BYTES = 8 * 2**20
#: Limits on a request's head (path and headers): past them, 431.
MAX_HEADERS = 100
MAX_HEADER_BYTES = 32 * 2**10
