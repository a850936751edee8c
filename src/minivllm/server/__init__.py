"""The OpenAI-compatible HTTP server: protocol models (protocol.py), endpoint logic
(serving.py), the FastAPI app (api_server.py), Prometheus metrics (metrics.py) and the
`minivllm serve` glue (launch.py). Importing this package imports nothing heavy."""
