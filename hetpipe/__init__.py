"""HetPipe shared core: wire codec, job schema, model zoo, data, WSP rules, gRPC plumbing."""
