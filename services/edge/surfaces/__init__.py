"""The OpenAI-compatible surfaces: each route's request parsing, its answer's shapes and its handler
(chat and completions, Responses, embeddings, tokenize, LoRA admin, the OpenAPI document)."""
