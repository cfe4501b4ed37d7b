"""The cross-host transport: TensorFlow's RecvTensor over gRPC.

Wire bytes (pure, no I/O): ``wire`` (protobuf primitives), ``tensors`` (a TensorProto
around an array's buffer), ``tf_dtypes`` (dtype codes), ``messages`` (RecvTensor's messages), ``mark_finished``
(MarkRecvFinished's), ``assembly`` (a chunked stream into one buffer). ``methods`` names the methods and limits both ends agree on;
``proto`` holds the generated reference modules (tools/gen_protos.py); ``security`` the
TLS and token options; ``rpc_errors`` reads a grpc error's code and details.

Producer side: ``outbox`` (the values sent to other hosts, and the window's
accounting), ``server`` (the server lifecycle), ``service`` (the handlers),
``waits`` (calls matched with values; ``tensor_source`` declares the outbox's side),
``response_cache`` (TensorFlow's GrpcResponseCache), ``limits`` (connection and call
bounds), ``request_gate`` (dropping calls that send no request). Consumer side:
``client`` (the consumer's client: receives in order per key), ``own_call`` (a
blocked receiver's call in its own thread, started by ``transport``), ``call`` (one receive;
its phases ``recv_unary`` and ``recv_stream``; ``recv_context``, what it is given),
``channels`` (a channel per peer, fork handling), ``acks`` (ack handling), ``runner``
(callback threads). ``transport`` composes the two for the Worker.

Thread model: docs/threads.md.
"""
