"""OpenAI's embeddings: request.py, render.py, routes.py."""
