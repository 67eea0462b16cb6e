"""A /dev/shm too small for a session's rings (Docker's default is 64 MiB; here 8 MiB, in a private
mount namespace): the engine refuses the rings when the session opens, says why, and the service
carries token ids in gRPC messages instead; nothing dies of SIGBUS later, nothing is left."""

from __future__ import annotations

import subprocess

import pytest

from gateway.client import LLMServeClient
from tests.fault_helpers import assert_engine_clean
from tests.service_process import ServiceProcess

# Mount an 8 MiB tmpfs over /dev/shm for the service alone, then become the service (same pid).
SMALL_SHM = ["unshare", "-m", "--propagation", "private", "sh", "-c"]
MOUNT_THEN_EXEC = 'mount -t tmpfs -o size=8m,mode=1777 tmpfs /dev/shm && exec "$@"'


def _can_make_a_private_dev_shm() -> bool:
    try:
        probe = subprocess.run([*SMALL_SHM, MOUNT_THEN_EXEC, "sh", "true"], capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return probe.returncode == 0


@pytest.mark.skipif(
    not _can_make_a_private_dev_shm(), reason="needs a private mount namespace (unshare -m) for /dev/shm"
)
def test_a_dev_shm_without_room_falls_back_to_grpc_transport(tiny_llama):
    sp = ServiceProcess(tiny_llama, "--transport", "shm", "--tokenizer-workers", "0")
    sp.cmd = [*SMALL_SHM, MOUNT_THEN_EXEC, "sh", *sp.cmd]
    sp.start()
    try:
        assert sp.transport == "grpc", sp.log_tail()  # asked for 16 + 4 MiB of rings; 8 MiB there
        log = sp.log_tail(10**6)
        assert "no shared-memory rings" in log and "has no room for a" in log, log
        with LLMServeClient(sp.target, timeout=60) as client:
            first = client.generate("héllo wörld", max_tokens=12, temperature=0, ignore_eos=True)
            again = client.generate("héllo wörld", max_tokens=12, temperature=0, ignore_eos=True)
        assert first.usage.completion_tokens == 12 and first.text == again.text
        assert "Bus error" not in sp.log_tail(10**6)
        assert_engine_clean(sp)
        assert sp.terminate(60) == 0, sp.log_tail()
    finally:
        sp.kill()
