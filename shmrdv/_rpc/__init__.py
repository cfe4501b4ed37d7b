"""The cross-host transport: TensorFlow's RecvTensor over gRPC.

Wire bytes (pure, no I/O): ``wire`` (protobuf primitives), ``tensors`` (a TensorProto
around an array's buffer), ``messages`` (the RPC messages), ``assembly`` (a chunked
stream into one buffer). ``methods`` names the methods and limits both ends agree on,
``proto`` holds the generated reference modules (tools/gen_protos.py), ``server`` answers
calls, ``client`` makes them (``link``: its Exchange stream per peer), ``security``
holds the TLS and token options and ``transport`` is the Worker's side of it all.
"""
