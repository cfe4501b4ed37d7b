"""The cross-host transport: TensorFlow's RecvTensor over gRPC.

Wire bytes (pure, no I/O): ``wire`` (protobuf primitives), ``tensors`` (a TensorProto
around an array's buffer), ``messages`` (the RPC messages), ``assembly`` (a chunked
stream into one buffer). ``methods`` names the methods and limits both ends agree on;
``proto`` holds the generated reference modules (tools/gen_protos.py); ``security`` the
TLS and token options; ``rpc_errors`` reads a grpc error's code and details.

Producer side: ``server`` (the server lifecycle), ``service`` (the handlers),
``response_cache`` (TensorFlow's GrpcResponseCache), ``limits`` (connection and call
bounds), ``request_gate`` (dropping calls that send no request). Consumer side: ``client`` (its
face), ``call`` (one receive's RPCs), ``channels`` (channel and link per peer, fork
handling), ``link`` (the Exchange stream per peer), ``acks`` (ack handling), ``runner``
(callback threads). ``transport`` is the Worker's side of it all.
"""
