"""Layer 4, many processes and machines: tensor parallelism's shards and collectives (the engine runs its ranks:
engine/tensor_parallel.py), and the cache-aware router in front of replicas."""
