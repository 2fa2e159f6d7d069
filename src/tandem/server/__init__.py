"""The OpenAI-compatible HTTP server: a FastAPI front end (tokenizer, detokenizer, metrics) talking
to the engine core process over ZMQ."""
