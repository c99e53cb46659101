"""Anthropic's Messages API: request.py, translate.py, render.py, routes.py."""
