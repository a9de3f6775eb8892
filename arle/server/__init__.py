"""The OpenAI-compatible HTTP server: app.py (routes), protocol.py (wire format), metrics.py.

NOTE: nothing is imported here: `arle serve --help` reads the constant below without loading
starlette or pydantic.
"""

#: Default request body limit: a whole context of text is far below it.
DEFAULT_MAX_BODY_BYTES = 8 * 2**20
