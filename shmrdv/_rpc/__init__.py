"""The cross-host transport: TensorFlow's RecvTensor over gRPC.

Pure byte formats: ``wire`` (protobuf primitives, dtype codes, TensorProto) and
``messages`` (one encoder and one decoder per message). ``guard``: TLS, the token, the
request gate and every bound. Producer: ``outbox`` (the values sent, the window),
``server`` (RecvTensor, the response cache), ``series`` (RecvTensorSeries, both ends).
Consumer: ``client`` (the one receive state machine). ``transport`` composes them for
the Worker; ``proto`` holds generated reference modules (tools/gen_protos.py).

Thread model: docs/threads.md.
"""
