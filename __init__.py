"""snapkernel: a REST server that runs notebook cells against named, immutable, persistent
execution states (kernel/: the server and its workers; storage/: the store; api/: HTTP)."""
