"""The request router across engine replicas (KV-aware prefix routing).

prefix_index: which replica caches which full KV blocks (a radix tree over chained block
hashes); load: each replica's active load from the router's own dispatches; policy: the
choice (kv, round-robin, least-loaded, random); router: one decision per request;
events: applying a replica's numbered KV events and snapshots to the index; replicas:
N engine clients behind one engine-client interface, with per-replica health;
replica_stats / metrics: the replicas in GetServerInfo and Prometheus; options /
cli_args: the serve flags; launch: the replicas' processes. No JAX.
"""
