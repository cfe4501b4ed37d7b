"""The cross-host transport: TensorFlow's RecvTensor over gRPC.

``coding`` builds and parses the wire bytes (pure), ``proto`` holds the generated
reference modules (tools/gen_protos.py), ``server``/``client`` carry the bytes and
``security`` holds the TLS and token options.
"""
