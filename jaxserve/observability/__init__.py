"""Observability: the typed stats records the engine sends (`stats`) and the Prometheus
registry the frontend exports them in (`metrics`). No JAX here."""
