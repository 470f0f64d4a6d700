"""The OpenAI-compatible HTTP front (Starlette on uvicorn, inside the daemon's event loop)."""
