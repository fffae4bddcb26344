"""kiln's gRPC API: ``kiln.proto`` (the contract), its checked-in generated modules ``kiln_pb2`` and
``kiln_pb2_grpc`` (regenerated with grpcio-tools; a test checks they match the .proto), the
proto <-> HTTP-body conversions (``convert``) and the servicer and server start-up (``servicer``)."""
