"""The HTTP edge: the OpenAI-compatible Starlette app and everything between a socket and
`AsyncEngine`.

- `server`: the app, its routes, start-up, readiness and SIGTERM drain;
- `openai_api`: the request/response schemas and their validation;
- `errors`: one error path, an OpenAI error body for every non-2xx answer;
- `tool_calls`: tools through the chat template, calls parsed and streamed as deltas;
- `guard`: uvicorn h11 protocol limits (read timeout, connection cap);
- `logs`: access-log filtering (no query strings, no line per malformed request);
- `linger`: the lingering close after an early answer, so clients read it, not a reset;
- `body`: request bodies read within the byte limit, gzip/deflate decoded.
"""
