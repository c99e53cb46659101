"""Chat output and tool calling: one class per tool-call style (styles/, named in
registry.py), the reasoning splitter, a choice's output, a chat request's plan.

Kept free of imports: wsllm.config_gateway reads the registry, and must not pull in the rest."""
