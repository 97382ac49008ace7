"""jlight.serve: the OpenAI-compatible HTTP server (`jlight serve`) and its benchmark client.

Nothing is imported here: `import jlight` must not pull in fastapi/uvicorn. Entry points:
serve.app.build_app (the FastAPI app), serve.cli (the command), serve.bench_cli (the
serving benchmark).
"""
