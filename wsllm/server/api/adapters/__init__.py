"""vLLM's LoRA adapter routes, for the operator: request.py, routes.py."""
