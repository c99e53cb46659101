"""OpenAI's chat completions, completions and models, with the stream resume (routes.py, render.py)."""
