"""`jaxserve bench`: a serving benchmark client in the style of `vllm bench serve`.

datasets.py builds the prompts, backends.py sends and times one request (gRPC or the
OpenAI HTTP API), client.py drives the traffic (Poisson rate or fixed concurrency),
report.py computes the statistics, table and JSON, plot.py draws the PNG, cli.py is the
subcommand. Nothing here imports JAX.
"""
