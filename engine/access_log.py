"""The access log without query strings: clients put secrets there (`?api_key=...`), and
nothing this server serves reads them."""

from __future__ import annotations

import logging

ACCESS_LOGGER = "uvicorn.access"
REDACTED = "?[redacted]"


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


def redact_access_log() -> None:
    """Install the filter on uvicorn's access logger (after uvicorn configured its logging)."""
    logger = logging.getLogger(ACCESS_LOGGER)
    if not any(isinstance(f, RedactQueryStrings) for f in logger.filters):
        logger.addFilter(RedactQueryStrings())
