"""One module per tool-call style, each a `ToolStyle` subclass (chat/style.py) listed
once in chat/registry.py."""
