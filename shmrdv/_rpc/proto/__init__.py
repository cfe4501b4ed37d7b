"""Generated protobuf modules for protos/shmrdv/*.proto. Do not edit.

Regenerate with ``python3 tools/gen_protos.py``; ``--check`` fails when they drift.
shmrdv's wire coding (shmrdv/_rpc/wire.py) does not import these modules: they are
the reference its tests compare against and the schema other tools can use.
"""
