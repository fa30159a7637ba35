"""The OpenAI-compatible API: `/v1/models`, `/v1/completions`, `/v1/chat/completions`.

`routes.register_openai_routes(app, tokenizer_manager)` is the only entry point the server
needs; `protocol` holds the request models, `responses` the response shapes, `serving_*`
the handlers.
"""
