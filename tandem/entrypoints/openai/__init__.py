"""OpenAI-compatible HTTP server: FastAPI app factory, request models, errors, metrics."""
