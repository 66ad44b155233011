"""Data at scale: datasets and full passes, decoding, the S3 store, heavy copies off the request
path, and one adapt job sharded over several workers."""
