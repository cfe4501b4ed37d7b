"""A full /dev/shm is a ResourceExhaustedError, never a raw OSError (issue 13 §5)."""

from __future__ import annotations

from small_shm import run_with_small_dev_shm

_FULL_WORKER = r"""
import errno, os, shmrdv
# Fill the private 1 MiB /dev/shm to the last byte.
fd = os.open("/dev/shm/filler", os.O_CREAT | os.O_WRONLY, 0o600)
try:
    while True:
        os.write(fd, b"x" * 4096)
except OSError as e:
    assert e.errno == errno.ENOSPC, e
os.close(fd)
try:
    shmrdv.Worker("/job:w/replica:0/task:0", namespace=shmrdv.new_namespace())
except shmrdv.ResourceExhaustedError as e:
    print("refused:", e)
    assert "/dev/shm" in str(e), e
else:
    raise AssertionError("Worker() on a full /dev/shm did not raise")
left = sorted(set(os.listdir("/dev/shm")) - {"filler"})
assert not left, left
# Room for the presence record only (one page): the doorbell finds /dev/shm full.
size = os.stat("/dev/shm/filler").st_size
os.truncate("/dev/shm/filler", size - 4096)
try:
    shmrdv.Worker("/job:w/replica:0/task:0", namespace=shmrdv.new_namespace())
except shmrdv.ResourceExhaustedError as e:
    print("refused:", e)
    assert "doorbell" in str(e), e
else:
    raise AssertionError("Worker() with no room for its doorbell did not raise")
left = sorted(set(os.listdir("/dev/shm")) - {"filler"})
assert not left, left
os.unlink("/dev/shm/filler")
with shmrdv.Worker("/job:w/replica:0/task:0", namespace=shmrdv.new_namespace()):
    pass
print("child ok")
"""


def test_full_dev_shm_worker_is_resource_exhausted() -> None:
    out = run_with_small_dev_shm(_FULL_WORKER, size="1m")
    assert out.count("refused:") == 2
