"""Same-host transport over POSIX shared memory (``/dev/shm``) and ``posix_ipc`` semaphores.

``transport`` ties ``producer`` and ``consumer`` (with ``recovery``) together over
``header`` and ``ring`` (byte formats), ``files`` and ``pool`` (segments),
``bell`` (doorbells), ``presence`` (liveness), ``naming`` and ``reaper`` (cleanup).
"""
