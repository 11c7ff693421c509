"""A fleet of servers for the tests and scripts/bench_fleet.py: `snapshot-kernel fleet`
(servers on moto's S3, HAProxy in front), started and stopped."""

import os
import re
import signal
import subprocess
import sys
import threading

from snapkernel.api.client import Client
from support.server import ROOT, free_port, wait_for


TOKEN = "fleet-token"


LINE = re.compile(r"^(server-\d+): http://127\.0\.0\.1:(\d+) pid (\d+)")


class Fleet:
    """The `fleet` command running, its servers' ports and pids read from its output."""

    def __init__(self, root, config, servers=3):
        """Start it and wait until HAProxy is up."""
        self.root = root
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.ports, self.pids, self.lines = {}, {}, []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "snapkernel.main", "fleet", "--servers", str(servers),
             "--bind", f"127.0.0.1:{self.port}", "--token", TOKEN, "--config", str(config),
             "--data-root", str(root), "--drain-s", "3"],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        wait_for(lambda: any(x.startswith("haproxy:") for x in self.lines) or
                 self.proc.poll() is not None, "the fleet to start", 180)
        assert self.proc.poll() is None, "\n".join(self.lines)

    def _read(self):
        """Keep the fleet's lines; note each server's port and current pid."""
        for line in self.proc.stdout:
            self.lines.append(line.rstrip())
            found = LINE.match(line)
            if found:
                self.ports[found[1]] = int(found[2])
                self.pids[found[1]] = int(found[3])

    def client(self, affinity=None):
        """A client of HAProxy."""
        return Client(self.url, TOKEN, affinity=affinity)

    def direct(self, name):
        """A client of server `name` itself."""
        return Client(f"http://127.0.0.1:{self.ports[name]}", TOKEN)

    def kill(self, name, sig=signal.SIGKILL):
        """Signal server `name`; its pid then."""
        pid = self.pids[name]
        os.kill(pid, sig)
        return pid

    def wait_back(self, name, old_pid):
        """Wait until server `name` runs again (a new pid answers /health)."""
        def back():
            pid = self.pids.get(name)
            if pid == old_pid:
                return False
            try:
                return self.direct(name).call("GET", "/health", timeout=2)["server"]["pid"] == pid
            except Exception:
                return False
        wait_for(back, f"{name} to be started again", 120)

    def wait_routed(self):
        """Wait until HAProxy sends requests to every server again: a server back on its
        port is routed to only after its health checks (rise 2, inter 1 s), and a
        session's requests meanwhile go to another one."""
        def routed():
            seen = set()
            for n in range(40):  # 40 keys hash to each of 3 servers but for 3e-7
                client = self.client(affinity=f"probe-{n}")
                try:
                    client.call("GET", "/health", timeout=5)
                except Exception:
                    return False
                seen.add(client.server)
            return seen == set(self.ports)
        wait_for(routed, "HAProxy to route to every server", 120)

    def stop(self):
        """SIGTERM; it stops everything."""
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(60)
