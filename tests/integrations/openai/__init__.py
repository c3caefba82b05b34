"""The model client for OpenAI-compatible servers, against the batching test server and llama.cpp."""
