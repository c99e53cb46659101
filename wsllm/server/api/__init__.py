"""One wing per API (openai, responses, messages, embeddings, tokenize): each its
request's shapes and checks, its translation into the chat request or its own render,
and its routes, filled into the skeleton every route shares (server/http.py). No wing
imports another; the app mounts each with one line (server/app.py, `WINGS`)."""
