"""Online serving: the `myvllm` command (serve, chat), the OpenAI-compatible HTTP server and
its request models, and the Prometheus metrics. The streaming engine they use is
myvllm.serving.async_llm."""
