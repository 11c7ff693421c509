"""The durable state store: LMDB blobs and manifests, serializer, alias groups."""
