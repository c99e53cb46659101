"""OpenAI's Responses API: request.py, translate.py, run.py, render.py, routes.py."""
