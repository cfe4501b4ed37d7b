"""Same-host transport over POSIX shared memory (``/dev/shm``) and ``posix_ipc`` semaphores.

Modules, one job each: ``naming`` (every OS object's name), ``layout`` (the segment
header byte format, pure), ``segment`` (creating, opening, mapping and unlinking segment
files: handle tracking lives there), ``presence`` (whether a worker lives: its record and
the one liveness monitor), ``bell`` (doorbell semaphores), ``reaper`` (listing /dev/shm and
collecting what dead workers left), ``transport`` (the rendezvous).
"""
