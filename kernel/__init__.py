"""The snapshot kernel: registry of states, worker processes, namespace, outputs."""
