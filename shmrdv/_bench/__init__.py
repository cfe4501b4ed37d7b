"""``shmrdv bench``: hand numpy arrays between two processes and time it, for shmrdv and its peers.

``options`` defines the command line and checks every value's range (standard library
only: the CLI builds it without loading the rest); ``common`` holds what every mode
shares (size lists, the key patterns, pinning); every mode's processes are
``shmrdv._procs`` children. ``runner`` drives each method, once per key pattern it has,
over the sizes (``main``, ``build_parser``, ``run``; ``--pending N`` is a set of its
methods) through ``pair`` (a method's pinger and ponger processes; ``role``: what runs in
them), with ``busy`` processes beside them on an oversubscribed host; ``selection`` picks
the methods. ``contract`` is what a method supplies, ``methods`` the one registry
(``METHODS``, ``register_method``); the methods live by family: ``floor_methods``,
``mp_methods``, ``zmq_methods``, ``framework_methods``, ``grpc_methods``,
``iceoryx_methods``, and ``shmrdv_methods`` shmrdv's own. ``results`` holds a run's
figures, ``machine`` what it ran on, ``report`` turns them into markdown (a summary first,
the tables per size with ``--details``), JSON and a plot. The other modes are whole runs of their
own: ``load`` (``--load``; ``load_plan``, ``load_roles``), ``soak`` (``--soak``;
``soak_plan``, ``soak_roles``, ``soak_sample``, ``soak_analysis``), ``pycost``
(``--python-cost``), ``fanin`` (``--fan-in N``), ``pipeline`` (``--pipeline``) and
``remote`` (``--peer HOST:PORT``, against ``echo``, the echo peer of ``shmrdv serve``).
``textfit`` fits every report into 100 columns. Nothing here is imported by
``import shmrdv``. Run it as ``python -m shmrdv bench`` or ``python tools/bench.py``; see
research/peer_numbers.md for the measurement it repeats.
"""
