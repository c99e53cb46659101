"""vLLM's /tokenize and /detokenize: request.py, routes.py."""
