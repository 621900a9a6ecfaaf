"""The gRPC frontend, the detokenizer sidecar and the process model, on the mock engine
(a package, so that its conftest does not shadow tests/conftest.py)."""
