"""Keeps a kernelspec's server up while kernels use it, and stops it after.

Run as a script by the kernel that starts the server (standard library
only, so it needs no import path): `python server_keeper.py FOLDER IDLE_S --
COMMAND...`. It runs in a session of its own, so neither Jupyter's kill of
a kernel's process group nor ipykernel's reaping of its children reaches
it: several kernels share the server, and a restarted kernel finds it.

Every kernel holds a shared lock on FOLDER/kernels.lock while it lives
(the system drops it when the kernel dies, however it dies). Once no
kernel has held it for IDLE_S seconds, the keeper stops the server,
under FOLDER/start.lock so that no kernel attaches meanwhile. It exits
with its server.
"""

import fcntl
import os
import signal
import subprocess
import sys
import threading
import time


def main(argv):
    """Start the server and watch the kernels' lock until none is left."""
    if len(argv) < 4 or argv[2] != "--":
        sys.exit("usage: server_keeper.py FOLDER IDLE_S -- COMMAND...")
    folder, idle_s, _, *command = argv
    server = subprocess.Popen(command, stdin=subprocess.DEVNULL)

    def stop(*_):
        """Stop the server and leave (SIGTERM, or no kernel left)."""
        server.terminate()
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
        os._exit(0)

    signal.signal(signal.SIGTERM, stop)
    # A server that exits on its own (crash, failed start) ends the keeper too.
    threading.Thread(target=lambda: (server.wait(), os._exit(0)), daemon=True).start()
    kernels = open(os.path.join(folder, "kernels.lock"), "a")
    while True:
        fcntl.flock(kernels, fcntl.LOCK_EX)  # returns when no kernel holds it
        fcntl.flock(kernels, fcntl.LOCK_UN)
        time.sleep(float(idle_s))
        with open(os.path.join(folder, "start.lock"), "a") as start:
            fcntl.flock(start, fcntl.LOCK_EX)
            try:
                fcntl.flock(kernels, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # a kernel came back meanwhile
            try:
                os.unlink(os.path.join(folder, "server.json"))
            except FileNotFoundError:
                pass
            stop()


if __name__ == "__main__":
    main(sys.argv[1:])
