"""What the HTTP edge writes to the log, and what it keeps out of it.

- The access log without query strings: clients put secrets there (`?api_key=...`), and
  nothing this server serves reads them.
- No line per malformed HTTP request: uvicorn warns about each one, so any client could flood
  the log; `engine/http/guard.py` counts them instead.
"""

from __future__ import annotations

import logging

ACCESS_LOGGER = "uvicorn.access"
ERROR_LOGGER = "uvicorn.error"
REDACTED = "?[redacted]"
# uvicorn's per-request warning for input its HTTP parser rejects (answered 400 all the same).
MALFORMED_REQUEST_WARNING = "Invalid HTTP request received."


class RedactQueryStrings(logging.Filter):
    """Rewrites uvicorn's access record, whose arguments are
    (client, method, path with query string, HTTP version, status)."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) == 5 and isinstance(args[2], str):
            path, sep, _ = args[2].partition("?")
            if sep:
                record.args = (args[0], args[1], path + REDACTED, *args[3:])
        return True


class DropMalformedRequestWarnings(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.msg != MALFORMED_REQUEST_WARNING


def install_http_log_filters() -> None:
    """Install both filters on uvicorn's loggers (after uvicorn configured its logging)."""
    for name, kind in ((ACCESS_LOGGER, RedactQueryStrings),
                       (ERROR_LOGGER, DropMalformedRequestWarnings)):  # fmt: skip
        logger = logging.getLogger(name)
        if not any(isinstance(f, kind) for f in logger.filters):
            logger.addFilter(kind())
