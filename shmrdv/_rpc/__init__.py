"""The cross-host transport: TensorFlow's RecvTensor over gRPC.

Byte formats ``wire`` and ``messages``; ``guard`` (TLS, token, bounds); producer
``outbox``, ``server``, ``series`` (both ends); consumer ``client``; ``transport``
composes them for the Worker; ``proto``: generated reference modules. Threads:
docs/threads.md.
"""
